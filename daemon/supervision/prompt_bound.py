"""What a worker's vocabulary says of a prompt before anything tokenizes it."""

from __future__ import annotations

import re
from dataclasses import dataclass

_DROPPABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True)
class PromptBound:
    """What a model's vocabulary says of a prompt's token count before anything tokenizes
    it. Tokenizing takes time that grows faster than the text (special tokens: quadratic in
    their count in llama.cpp), and it happens in a worker where every other request waits
    behind it, so a prompt that cannot fit is refused first, in linear time."""

    longest_token_bytes: int = 1  # a token stands for at most this many bytes
    specials: re.Pattern[str] | None = None  # control tokens' texts: one token each

    @classmethod
    def of(cls, token_bytes: list[bytes], special_tokens: list[int]) -> PromptBound:
        texts = {
            token_bytes[i].decode(errors="ignore")
            for i in special_tokens
            if 0 <= i < len(token_bytes)
        }
        texts.discard("")
        # longest first, so that a special inside a longer one is not counted twice
        alternatives = sorted(texts, key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        return cls(max(map(len, token_bytes), default=1), pattern)

    def least_tokens(self, prompt: str) -> int:
        """A lower bound on the tokens ``prompt`` takes: each special token's text it holds
        is one token, and the rest takes at least its bytes over the longest token's, but
        for control characters, which a vocabulary may drop (SmolLM2's has no token for six
        of them)."""
        size = len(_DROPPABLE.sub("", prompt).encode())
        specials = special_bytes = 0
        if self.specials is not None:
            for match in self.specials.finditer(prompt):
                specials += 1
                special_bytes += len(match.group().encode())
        return specials + -(-(size - special_bytes) // max(1, self.longest_token_bytes))

    def check(self, prompt: str, context: int) -> None:
        """Refuse (ValueError) a prompt that cannot fit ``context`` whatever its tokens."""
        tokens = self.least_tokens(prompt)
        if tokens > context:
            raise ValueError(
                f"the prompt is {len(prompt.encode()):,} bytes, at least "
                f"{tokens:,} tokens, which cannot fit the {context}-token "
                "context"
            )

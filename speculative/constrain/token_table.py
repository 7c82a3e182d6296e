"""The target's vocabulary as the grammar library reads it: each id's bytes, control tokens
marked (they never match grammar text), the ids that end generation."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import llguidance

from hetspec.protocol.vocab import VocabInfo

# llguidance's mark for a token that stands for no text (a control token)
SPECIAL_MARK = b"\xff"


def vocabulary_ends(vocab: VocabInfo) -> set[int]:
    """The ids that end generation in ``vocab`` (EOS and the end-of-turn tokens): where a
    grammar may end, one of them is allowed."""
    return {vocab.eos, *vocab.ends} - {-1}


def grammar_tokenizer(
    token_bytes: Sequence[bytes], special: Iterable[int], ends: Iterable[int]
) -> llguidance.LLTokenizer:
    """An ``LLTokenizer`` over the target's vocabulary. ``special``: control tokens;
    ``ends``: the ids that end generation (at least one), allowed where the grammar may end.
    Text is tokenized greedily over the same vocabulary (the library uses it only to turn
    forced bytes into tokens; a forced token is still checked by the target's rows). Takes
    ~0.3 s for 50k tokens: build one per vocabulary."""
    ends = sorted(set(ends))
    if not ends:
        raise ValueError("a grammar needs at least one token that ends generation")
    special = set(special) | set(ends)
    tokens = [SPECIAL_MARK + b if i in special else bytes(b) for i, b in enumerate(token_bytes)]
    greedy = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocabulary(tokens, ends[0], lambda text: []))
    )

    def tokenize(text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return greedy.greedy_tokenize(text)

    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocabulary(tokens, ends[0], tokenize)), eos_token=ends
    )


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer."""

    bos_token_id = None

    def __init__(self, tokens: list[bytes], eos: int, tokenize) -> None:
        self.tokens, self.eos_token_id, self._tokenize = tokens, eos, tokenize
        self.special_token_ids: list[int] = []  # marked in the bytes instead

    def __call__(self, text: bytes | str) -> list[int]:
        return self._tokenize(text)

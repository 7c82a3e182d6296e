"""One request's grammar state, and the target's rows as the grammar lets it choose.

Lossless under the grammar: every row the verdict reads is the target's row with the tokens
the grammar forbids after that row's prefix set to -inf, so greedy verification returns the
constrained target's own greedy output and speculative sampling follows the masked,
renormalized target law, whatever the draft proposed (a forbidden drafted token has target
probability 0 and is never kept).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import llguidance
import numpy as np

from hetspec.speculative.constrain.grammars import GrammarError, parser_limits
from hetspec.speculative.verify.verdicts import RowsOnDemand


class ConstraintBroken(RuntimeError):
    """Tokens the grammar forbids reached a committed state: a bug, never the request's."""


class Constraint:
    """A grammar's state after the tokens it was given (``advance``, ``follow``): ``text``
    the grammar (llguidance's), ``consumed`` those tokens."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        """Compile ``grammar`` (``grammars.grammar_text``'s) for ``tokenizer``'s vocabulary;
        ``GrammarError`` where it does not compile. Drops the GIL while it compiles."""
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {matcher.get_error()}")
        self._start(matcher, tokenizer.vocab_size, grammar)

    def _start(self, matcher: llguidance.LLMatcher, vocab: int, text: str) -> None:
        self._matcher, self.vocab, self.text = matcher, vocab, text
        self.consumed: list[int] = []
        self._bits = np.full((vocab + 31) // 32, -1, np.int32)
        self.masks, self.mask_s = 0, 0.0  # masks computed and their time (the grammar's cost)

    def fresh(self) -> Constraint:
        """The same grammar from its start, without compiling it again (a request decoded
        again after a worker died)."""
        matcher = self._matcher.deep_copy()
        matcher.reset()
        copy = Constraint.__new__(Constraint)
        copy._start(matcher, self.vocab, self.text)
        return copy

    def advance(self, tokens: Sequence[int]) -> None:
        """The text grew by ``tokens`` (each allowed where it stands)."""
        if tokens and not self._matcher.consume_tokens(list(tokens)):
            raise ConstraintBroken(f"tokens broke the grammar: {self.error()}")
        self.consumed += tokens

    def follow(self, tokens: Sequence[int]) -> None:
        """Make the consumed tokens ``tokens``: back to what they share, then on (a worker's
        committed sequence after its last call's drafted tokens were refused or kept)."""
        shared = 0
        for mine, theirs in zip(self.consumed, tokens, strict=False):
            if mine != theirs:
                break
            shared += 1
        if shared < len(self.consumed):
            if not self._matcher.rollback(len(self.consumed) - shared):
                raise ConstraintBroken(f"the grammar could not go back: {self.error()}")
            del self.consumed[shared:]
        self.advance(list(tokens[shared:]))

    def error(self) -> str:
        return self._matcher.get_error()

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more but ending."""
        return self._matcher.is_stopped()

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (jump-forward): the only
        continuation it allows, tokenized as the library's canonical tokens."""
        return self._matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def allowed(self) -> np.ndarray:
        """Which of the vocabulary's tokens the grammar allows next (bool, vocab)."""
        start = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), count=self.vocab, bitorder="little")
        self.masks += 1
        self.mask_s += time.perf_counter() - start
        return bits.view(np.bool_)

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one logits row with what the grammar forbids next at -inf (entries past
        the vocabulary, a runtime's padding, too). Past the grammar's end (it took an end
        token, and allows nothing: nothing after it is emitted) the row is left as it is."""
        allowed = np.flatnonzero(self.allowed())
        if not len(allowed):
            return np.array(logits, np.float32)
        out = np.full(logits.shape[-1], -np.inf, np.float32)
        out[allowed] = logits[allowed]
        return out

    def try_advance(self, token: int) -> bool:
        """``advance`` by one token where the grammar takes it; False (nothing changed) past
        its end."""
        if self._matcher.is_stopped() or not self._matcher.try_consume_tokens([token]):
            return False
        self.consumed.append(token)
        return True

    def rows(self, target, tokens: Sequence[int], parents: Sequence[int]) -> RowsOnDemand:
        """The target's rows of a verified tree (row 0 after the committed text, row i + 1
        after node i), each masked by the grammar's state after its own prefix, computed when
        the walk reads it. A row below a node the grammar forbids is never read by a walk
        (that node's target probability is 0); reading one is a ``ConstraintBroken``. Rows
        past the grammar's end (below an end token, where nothing is emitted) are unmasked."""
        tokens, parents = list(tokens), list(parents)

        def read(row: int) -> np.ndarray:
            path, node = [], row - 1
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            path.reverse()
            consumed = self._matcher.try_consume_tokens(path)
            try:
                if consumed != len(path) and not self._matcher.is_stopped():
                    raise ConstraintBroken(f"row {row} lies below a token the grammar forbids")
                return self.masked(target[row])
            finally:
                if consumed:
                    self._matcher.rollback(consumed)

        return RowsOnDemand((len(tokens) + 1, target.shape[-1]), read)

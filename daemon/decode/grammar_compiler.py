"""Requests' grammars compiled for the served target's vocabulary, each within a bounded time.

The vocabulary's table for the grammar library (~0.3 s for 50k tokens) is built once per
verifier start-up (a restarted worker's ``Ready`` may name another model) and kept; a grammar
compiles in a thread, so a pathological one that runs long is cut off with a
``GrammarError`` while the daemon keeps serving.
"""

from __future__ import annotations

import asyncio

import llguidance

from hetspec.protocol import worker_messages as m
from hetspec.speculative.constrain.constraint import Constraint
from hetspec.speculative.constrain.grammars import Grammar, GrammarError
from hetspec.speculative.constrain.token_table import grammar_tokenizer, vocabulary_ends

COMPILE_S = 10.0  # a grammar's compile, the vocabulary's table included on first use


class GrammarCompiler:
    def __init__(self, timeout_s: float = COMPILE_S) -> None:
        self.timeout_s = timeout_s
        self._table: tuple[m.Ready, llguidance.LLTokenizer] | None = None

    async def compile(self, grammar: Grammar, ready: m.Ready) -> Constraint:
        """A constraint at its start for ``grammar`` over ``ready``'s vocabulary (the
        verifier's); ``GrammarError`` naming the problem, or the time limit it ran past."""
        text = grammar.text()

        def build() -> Constraint:
            return Constraint(self._tokenizer(ready), text)

        try:
            return await asyncio.wait_for(asyncio.to_thread(build), self.timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"the grammar did not compile within {self.timeout_s:g} s; simplify it"
            ) from None

    def _tokenizer(self, ready: m.Ready) -> llguidance.LLTokenizer:
        if self._table is None or self._table[0] is not ready:
            vocab = ready.vocab
            table = grammar_tokenizer(
                ready.token_bytes, ready.special_tokens, vocabulary_ends(vocab)
            )
            self._table = (ready, table)
        return self._table[1]

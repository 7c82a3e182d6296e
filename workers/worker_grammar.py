"""The request's grammar in a worker: the state its committed tokens reached, so that a draft
and the target decoding alone choose only tokens it allows.

The vocabulary's table for the grammar library (``GrammarTable``) is built from the runtime's
own vocabulary when a command first carries a grammar (~0.3 s for 50k tokens), once per loaded
model, and shared by the grammars of all its sequences; each sequence's ``WorkerGrammar`` keeps
the grammar of its last command, which follows that sequence's committed tokens from call to
call (a refused draft's tokens are rolled back, the accepted ones kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import llguidance

from hetspec.protocol import worker_messages as m
from hetspec.speculative.constrain.constraint import Constraint
from hetspec.speculative.constrain.token_table import grammar_tokenizer, vocabulary_ends


class GrammarTable:
    """The grammar library's table of a runtime's vocabulary, built when first asked and kept
    while that runtime is the one asked about."""

    def __init__(self) -> None:
        self._table: tuple[object, llguidance.LLTokenizer] | None = None

    def of(self, runtime) -> llguidance.LLTokenizer:
        if self._table is None or self._table[0] is not runtime:
            vocab = runtime.vocab_info()
            token_bytes = [runtime.token_bytes(i) for i in range(runtime.vocab_size)]
            table = grammar_tokenizer(token_bytes, runtime.special_tokens(), vocabulary_ends(vocab))
            self._table = (runtime, table)
        return self._table[1]


class WorkerGrammar:
    def __init__(self, runtime: Callable[[], object], table: GrammarTable | None = None) -> None:
        self._runtime = runtime  # the loaded runtime (whose vocabulary), when asked
        self._table = table or GrammarTable()  # shared by a worker's sequences
        self._constraint: Constraint | None = None
        self._start = 0
        self._since: tuple[int, float, float] | None = None  # masks, seconds, compile ms

    def cost(self) -> m.GrammarCost | None:
        """What the grammar computed since ``at`` (None: the command had none)."""
        if self._since is None or self._constraint is None:
            return None
        masks, seconds, compile_ms = self._since
        self._since = None
        kept = self._constraint
        return m.GrammarCost(kept.masks - masks, (kept.mask_s - seconds) * 1000, compile_ms)

    def at(self, grammar: m.GrammarAt | None, committed: Sequence[int]) -> Constraint | None:
        """``grammar``'s state after ``committed[grammar.start:]`` (None: no grammar)."""
        self._since = None
        if grammar is None:
            return None
        began, kept = time.perf_counter(), self._constraint
        compile_ms = 0.0
        if kept is None or kept.text != grammar.text or self._start != grammar.start:
            kept = self._constraint = Constraint(self._tokenizer(), grammar.text)
            self._start = grammar.start
            compile_ms = (time.perf_counter() - began) * 1000
        kept.follow(committed[grammar.start :])
        self._since = (kept.masks, kept.mask_s, compile_ms)
        return kept

    def _tokenizer(self) -> llguidance.LLTokenizer:
        return self._table.of(self._runtime())

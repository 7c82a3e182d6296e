"""Decoding alone, one token at a time: the choices ``TreeRuntime.decode`` makes, kept apart
from the forwards between them, so that several sequences' steps can share one forward
(the worker's batched ``Decode``) and still draw exactly the tokens each draws on its own.

Contract: ``DecodeSteps.draw`` chooses the token at a position from the logits after the
tokens before it (masked by the grammar where there is one; greedy: the argmax, as
``verify_greedy`` takes it; else the sampler's choice at that position), keeps it in
``drawn`` (and its log-probability in ``logprobs``) and says whether another token follows:
then the caller evaluates that token, commits it and draws again from its logits. It stops
after ``steps`` tokens, or at one of ``ends`` (the last: nothing after it is emitted).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from hetspec.protocol.sampling import TokenLogprob
from hetspec.speculative.constrain.constraint import Constraint
from hetspec.speculative.verify.distributions import SamplingParams, distribution
from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.speculative.verify.samplers import Sampler
from hetspec.workers.runtimes.pending_tree import RuntimeUsageError


class DecodeSteps:
    """One sequence's tokens drawn alone (see the module's contract)."""

    def __init__(
        self,
        steps: int,
        params: SamplingParams,
        sampler: Sampler,
        *,
        logprobs: list[TokenLogprob] | None = None,
        top: int = 0,
        grammar: Constraint | None = None,
        ends: Collection[int] = (),
    ) -> None:
        if steps < 1:
            raise RuntimeUsageError(f"cannot decode {steps} tokens")
        self.steps = steps
        self.params = params
        self.sampler = sampler
        self.logprobs = logprobs
        self.top = top
        self.grammar = grammar
        self.ends = ends
        self.drawn: list[int] = []

    def draw(self, logits: np.ndarray, position: int) -> bool:
        """Choose the token at ``position`` (its index in the whole sequence, for a keyed
        sampler) from ``logits``; whether another token is to follow it."""
        if self.grammar is not None:
            logits = self.grammar.masked(logits)
        if self.params.greedy:
            token = int(logits.argmax())
        else:
            rows = distribution(logits[None], self.params)
            token = int(self.sampler.choose(rows, position)[0])
        if self.grammar is not None:
            self.grammar.try_advance(token)  # past its end (an end token), nothing is emitted
        self.drawn.append(token)
        if self.logprobs is not None:
            self.logprobs.append(token_logprob(logits, token, self.top))
        return len(self.drawn) < self.steps and token not in self.ends

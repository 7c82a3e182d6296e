"""Several sequences' drafts in one forward a step: the drafter's side of several requests.

Requests decoding at once each send the drafter a ``Draft``; drafted one after the other, the
drafts end apart and their verifications reach the verifier apart, in half-full forwards. A
``Draft`` taken while other sequences' are queued takes them along (``CommandReader.
take_along``) and ``draft_together`` drafts them all: the catch-ups (each command's ``append``)
in one forward, then one forward a step holding each still drafting sequence's last token.

Contract: plain chains only (``plain_draft``: one chain, no grammar, no head's features); each
sequence's tokens and probability rows are exactly what its ``Draft`` alone gives (the kernels'
rows are bit for bit a single sequence's; each chain draws from its own sampler at its own
positions, as ``TreeRuntime.draft`` does), and each reply goes out (``early``) as soon as its
chain is drafted, its ``elapsed_ms`` from the batch's start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from hetspec.protocol import worker_messages as m
from hetspec.speculative.verify.distributions import distribution
from hetspec.speculative.verify.samplers import pick, proposals
from hetspec.speculative.verify.tree import ROOT
from hetspec.workers.runtimes.sequence_work import Chunk, Tree

Result = tuple | Exception  # a command's (reply, arrays), or why it failed


def plain_draft(command: msgspec.Struct) -> bool:
    """Whether a ``Draft`` may be drafted beside other sequences' (one chain, no grammar, no
    head's features)."""
    return (
        isinstance(command, m.Draft)
        and isinstance(command.shape, m.Chains)
        and command.shape.branches == 1
        and command.shape.steps >= 1
        and command.grammar is None
        and command.features is None
    )


@dataclass(eq=False)
class _Chain:
    """One ``Draft`` of the batch: its engine and sampler, its rows and tokens so far."""

    index: int
    command: m.Draft
    engine: object
    sampler: object
    out: np.ndarray  # (1, steps, vocab): the arena slot's rows
    tokens: np.ndarray  # (1, steps)
    nodes: np.ndarray  # (1, steps)
    position: int = 0  # the first drafted token's position in the sequence
    append_ms: float = 0.0
    forwards: int = 0

    @property
    def steps(self) -> int:
        return self.tokens.shape[1]


def draft_together(
    commands: Sequence[m.Draft],
    state_of: Callable[[int], object],
    slot: Callable[[int, tuple[int, ...]], np.ndarray],
    evaluate: Callable[[list[Tree | Chunk]], list[np.ndarray | Exception]],
    early: Callable[[int, Result], None] | None = None,
) -> list[Result]:
    """Each command's result, in their order (see the module's contract). ``state_of
    (sequence)``: its ``SequenceState``; ``slot(out, shape)``: the arena rows; ``evaluate``:
    every item's rows from one forward (each item's own error where it was refused)."""
    start = time.perf_counter()
    results: list[Result | None] = [None] * len(commands)
    chains = _chains(commands, state_of, slot, results)
    catch_ups = [(c, Chunk(c.engine, list(c.command.append))) for c in chains if c.command.append]
    first_logits = _caught_up(catch_ups, evaluate, results, start)
    going = _first_tokens(chains, first_logits, results)
    step = 1
    while going := _finish(going, step, results, start, early):
        going = _step(going, step, evaluate, results, early)
        step += 1
    return results


def _chains(commands, state_of, slot, results) -> list[_Chain]:
    """A chain a command, its rows in its arena slot (a refusal is that command's result)."""
    chains = []
    for index, command in enumerate(commands):
        try:
            state = state_of(command.sequence)
            engine = state.engine
            steps = command.shape.steps
            out = slot(command.out, (1, steps, engine.vocab_size))
        except Exception as error:  # answered as Failed, as the loop answers any command
            results[index] = error
            continue
        tokens = np.empty((1, steps), np.int64)
        nodes = np.full((1, steps), -1, np.int64)
        chains.append(_Chain(index, command, engine, state.sampler, out, tokens, nodes))
    return chains


def _first_tokens(chains: list[_Chain], first_logits: dict, results) -> list[_Chain]:
    """Each chain's first token, drawn from its catch-up's logits (or the committed end's);
    the chains that drew one."""
    going = []
    for chain in chains:
        if results[chain.index] is not None:
            continue
        try:
            logits = first_logits.get(chain.index)
            if logits is None:
                logits = chain.engine.last_logits()
            chain.engine.discard_pending()
            chain.position = chain.engine.committed
            params = chain.command.sampling
            distribution(logits, params, out=chain.out[0, 0])
            row = chain.out[0, 0]
            chain.tokens[:, 0] = proposals(row, params, chain.sampler, chain.position, 1)
        except Exception as error:
            results[chain.index] = error
            continue
        going.append(chain)
    return going


def _step(going: list[_Chain], step: int, evaluate, results, early) -> list[_Chain]:
    """One forward of every chain's last token, and each chain's next token drawn from it;
    the chains that drew one (a failure is that command's result, answered at once)."""
    work = []
    for chain in going:
        parent = chain.nodes[0, step - 2] if step > 1 else ROOT
        chain.nodes[0, step - 1] = chain.engine.pending
        work.append(Tree(chain.engine, [int(chain.tokens[0, step - 1])], [parent], True))
    drawn = []
    for chain, rows in zip(going, evaluate(work), strict=True):
        try:
            if isinstance(rows, Exception):
                raise rows
            params = chain.command.sampling
            distribution(rows[-1], params, out=chain.out[0, step])
            position = chain.position + step
            chain.tokens[:, step] = pick(chain.out[:, step], params, chain.sampler, position)
            chain.forwards += 1
        except Exception as error:
            results[chain.index] = error
            if early is not None:
                early(chain.index, error)
            continue
        drawn.append(chain)
    return drawn


def _caught_up(catch_ups, evaluate, results, start: float) -> dict[int, np.ndarray]:
    """Every command's ``append`` in one forward: the logits each chain's first token is
    drawn from, by command index (a refusal is that command's result)."""
    if not catch_ups:
        return {}
    outputs = evaluate([chunk for _, chunk in catch_ups])
    append_ms = (time.perf_counter() - start) * 1000
    logits = {}
    for (chain, _), rows in zip(catch_ups, outputs, strict=True):
        chain.append_ms = append_ms
        if isinstance(rows, Exception):
            results[chain.index] = rows
        else:
            logits[chain.index] = rows
    return logits


def _finish(going: list[_Chain], step: int, results, start: float, early) -> list[_Chain]:
    """The chains drafted to their length by ``step`` tokens answered; the others."""
    left = []
    for chain in going:
        if step < chain.steps:
            left.append(chain)
            continue
        out = chain.out
        probs = m.ArrayRef(out.dtype.str, out.shape, slot=chain.command.out)
        reply = m.Drafted(
            chain.command.request,
            chain.tokens.tolist(),
            chain.nodes.tolist(),
            probs,
            (time.perf_counter() - start) * 1000,
            chain.append_ms,
            chain.forwards,
            ROOT,
        )
        results[chain.index] = (reply, ())
        if early is not None:
            early(chain.index, results[chain.index])
    return left

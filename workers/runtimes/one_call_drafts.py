"""Drafts in one call: where a runtime has a call that drafts a whole chain (``_run_chain``)
or greedy branches side by side (``_run_branches``), the steps ``draft`` would take one
forward at a time, done by that one call.

Contract: every method here leaves the pending tree, the committed sequence and the
``DraftResult`` it fills exactly as ``TreeRuntime.draft``'s step-by-step loop would (the same
tokens, nodes and probability rows), only in fewer calls; ``chains_in_one_call`` says where a
chain may take that path, and the ``_draft_*`` helpers answer False (nothing done) where it may
not. A runtime without the hooks (``None``) drafts step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetspec.speculative.verify.distributions import SamplingParams, distribution
from hetspec.speculative.verify.samplers import ChainDraws, Sampler
from hetspec.speculative.verify.tree import ROOT, ancestor_mask, depths, validate_parents
from hetspec.workers.runtimes.pending_tree import Output, PendingTree, RuntimeUsageError


@dataclass(frozen=True)
class DraftResult:
    tokens: np.ndarray  # (branches, steps) int64
    probs: np.ndarray  # (branches, steps, vocab) float32: the distribution each token came from
    # (branches, steps) pending-tree node of each token; -1 for the last step, which is drawn
    # but not evaluated (its keys/values are computed only if it is accepted).
    nodes: np.ndarray
    root: int = -1  # the pending node the branches hang from (-1: the committed end)


class OneCallDrafts(PendingTree[Output]):
    """``PendingTree`` with the optional hooks that draft in one call, and their use."""

    # Optional hook, a method where a runtime drafts a chain in one call: (first token, the
    # chain's positions, its ancestor mask as ``_run`` takes it, draws, temperature, and a
    # keyword ``probs_out``: where the probability rows may go) -> (the chain's tokens and the
    # choice after its last node, its nodes' ``_run`` output, the probability rows the tokens
    # came from, or a greedy chain's softmax rows, or None); each choice the argmax, or with
    # ``ChainDraws`` one from softmax(logits / temperature) as they say
    _run_chain = None
    # Optional hook, a method where a runtime drafts greedy branches side by side in one call:
    # (first tokens (branches,), forwards, the first tokens' position, their pending
    # ancestors' slots past the committed ones, probs: (branches, forwards + 1, vocab) whose
    # rows [:, 1:] receive the softmax rows, or None) -> (tokens (forwards + 1, branches), the
    # first ones in row 0, each next one the argmax; the nodes' ``_run`` output, step by step)
    _run_branches = None

    def _chain(
        self,
        first: int,
        root: int,
        count: int,
        draws: ChainDraws | None = None,
        temperature: float = 1.0,
        *,
        probs_out: np.ndarray | None = None,
    ):
        """``count`` new pending nodes below pending node ``root`` (ROOT: the committed end),
        the first holding token ``first``, each next one chosen from the last one's logits
        (the argmax, or as ``draws`` say, see ``_run_chain``), in one call of ``_run_chain``:
        the count + 1 tokens, the (count, vocab) float32 logits and the probability rows as
        ``_run_chain`` returns them (``probs_out``: where they may go)."""
        self._checked_tokens([first], count)
        existing = self.pending
        chain = validate_parents([root, *range(existing, existing + count - 1)], existing)
        node_depths = depths(chain, self._pending_depths)
        rows = ancestor_mask(chain, self._pending_mask)
        tokens, output, probs = self._run_chain(
            first, self.committed + node_depths, rows, draws, temperature, probs_out=probs_out
        )
        self.forwards += count
        tokens = np.asarray(tokens, np.int64)
        self._record_pending(tokens[:count], chain, node_depths, rows, output)
        return tokens, self._step_logits(output), probs

    def _draft_chained(
        self, draft: DraftResult, position: int, params: SamplingParams, sampler: Sampler
    ) -> bool:
        """A one-branch draft's steps after its first token (in place: ``draft`` holds it) in
        one ``_chain`` call, filled in as ``draft``'s loop fills them: greedy, or sampled at a
        temperature alone (top-k and top-p truncate the rows, which the call does not), each
        token chosen as the sampler's ``chain_draws`` say. False (nothing done) where
        ``chains_in_one_call`` says no (several branches, no such call, a truncating
        sampler, features captured)."""
        if not self.chains_in_one_call(params, branches=draft.tokens.shape[0]):
            return False
        steps = draft.tokens.shape[1]
        draws = None
        if not params.greedy:
            draws = sampler.chain_draws(position + 1, steps - 1, self.vocab_size)
        start = self.pending
        rows = draft.probs[0, 1:]
        chained, logits, probs = self._chain(
            int(draft.tokens[0, 0]),
            draft.root,
            steps - 1,
            draws,
            params.temperature,
            probs_out=rows,
        )
        draft.tokens[0] = chained
        draft.nodes[0, :-1] = start + np.arange(steps - 1)
        _chain_rows(rows, probs, logits, params)
        return True

    def _draft_branched(self, draft: DraftResult, params: SamplingParams) -> bool:
        """A greedy draft of several branches: its steps after the first tokens (in place:
        ``draft`` holds them) in one ``_run_branches`` call, the nodes laid out as ``draft``'s
        loop lays them (step by step, branch by branch). False (nothing done) where the runtime
        has no such call, the draft samples or features are captured."""
        branches, steps = draft.tokens.shape
        if self._run_branches is None or not params.greedy or self.features_sink is not None:
            return False
        count, existing = steps - 1, self.pending
        self._checked_tokens(draft.tokens[:, 0], count * branches)
        roots = np.full(branches, draft.root, np.int64)  # the first step's parents
        parents = validate_parents(
            np.concatenate([roots, existing + np.arange((count - 1) * branches)]), existing
        )
        node_depths = depths(parents, self._pending_depths)
        rows = ancestor_mask(parents, self._pending_mask)
        base = np.flatnonzero(rows[0, :existing])  # the root's pending ancestors, itself too
        tokens, output = self._run_branches(
            draft.tokens[:, 0], count, self.committed + int(node_depths[0]), base, draft.probs
        )
        self.forwards += count
        tokens = np.asarray(tokens, np.int64)
        self._record_pending(tokens[:count].reshape(-1), parents, node_depths, rows, output)
        draft.tokens[:, 1:] = tokens[1:].T
        draft.nodes[:, :-1] = existing + np.arange(count) * branches + np.arange(branches)[:, None]
        return True

    def chains_in_one_call(
        self, params: SamplingParams, branches: int = 1, dynamic: float | None = None
    ) -> bool:
        """Whether one ``_run_chain`` call drafts a ``draft`` of these arguments (one branch,
        no rule, a sampler the call has): where it does, ``catch_up`` and ``draft(first=...)``
        save the appended token a forward of its own; elsewhere ``append`` evaluates what is
        new in one forward."""
        truncates = 0 < params.top_k < self.vocab_size or params.top_p < 1
        return (
            self._run_chain is not None
            and self.features_sink is None
            and branches == 1
            and dynamic is None
            and (params.greedy or not truncates)
        )

    def _draft_after(
        self, first: int, steps: int, params: SamplingParams, sampler: Sampler, out: np.ndarray
    ) -> DraftResult:
        """``draft``'s one-branch chain, ``first`` appended in the same ``_run_chain`` call:
        its node, the chain's first, is committed, and the others stay pending below it."""
        self.discard_pending()
        self._checked_tokens([first], steps)
        position = self.committed  # first's; the drafted tokens follow it
        draws = None
        if not params.greedy:
            draws = sampler.chain_draws(position + 1, steps, self.vocab_size)
        chain = np.tri(steps, dtype=bool)
        rows = out[0]
        tokens, output, probs = self._run_chain(
            first, position + np.arange(steps), chain, draws, params.temperature, probs_out=rows
        )
        self.forwards += steps
        tokens = np.asarray(tokens, np.int64)
        self.tokens.append(first)
        if self.outputs_kept:
            self._last_logits = None
            self._last_node = (output, 0)
        else:
            self._last_logits = self._node_logits(output, 0)
        if steps > 1:  # the drafted nodes but the last, below first, from output's row 1 on
            self._record_pending(
                tokens[1:steps],
                np.arange(-1, steps - 2),
                np.arange(steps - 1),
                chain[1:, 1:],
                output,
                first=-1,
            )
        _chain_rows(rows, probs, self._step_logits(output), params)
        nodes = np.full((1, steps), -1, np.int64)
        nodes[0, :-1] = np.arange(steps - 1)
        return DraftResult(tokens[None, 1:], out, nodes)

    def _draft_below(
        self,
        after: tuple[int, int],
        steps: int,
        params: SamplingParams,
        sampler: Sampler,
        out: np.ndarray,
    ) -> DraftResult:
        """``draft``'s one-branch chain continuing a pending draft: ``after`` = (parent,
        token), token's node below pending node parent the ``_run_chain`` call's first."""
        parent, token = after
        existing = self.pending
        if not -1 <= parent < existing:
            raise RuntimeUsageError(f"parent {parent} is not a pending node (or -1)")
        depth = 0 if parent == ROOT else int(self._pending_depths[parent]) + 1
        position = self.committed + depth + 1  # the first drafted token's
        draws = None
        if not params.greedy:
            draws = sampler.chain_draws(position, steps, self.vocab_size)
        rows = out[0]
        tokens, logits, probs = self._chain(
            token, parent, steps, draws, params.temperature, probs_out=rows
        )
        _chain_rows(rows, probs, logits, params)
        nodes = np.full((1, steps), -1, np.int64)
        nodes[0, :-1] = existing + 1 + np.arange(steps - 1)
        return DraftResult(tokens[None, 1:], out, nodes, existing)


def _chain_rows(
    rows: np.ndarray, probs: np.ndarray | None, logits: np.ndarray, params: SamplingParams
) -> None:
    """A chain call's probability rows into ``rows``: those it returned (the rows its tokens
    were drawn from, as verification needs), or the distribution of its ``logits``."""
    if probs is None:
        distribution(logits, params, out=rows)
    elif probs is not rows:
        rows[...] = probs

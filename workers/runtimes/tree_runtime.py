"""What both engines share: a committed sequence, a pending token tree, and choosing tokens.

``TreeRuntime`` is the class every engine (llama.cpp, torch, native, the draft head) derives
from. It stacks three layers, one concern a module:

- ``pending_tree.PendingTree``: the committed sequence and the pending tree, evaluating and
  keeping nodes (no token is chosen there);
- ``one_call_drafts.OneCallDrafts``: drafting a chain, or greedy branches, in one call where
  the runtime has one;
- here: choosing tokens: ``decode`` (the target alone), ``draft`` (fixed branches, or
  DuoDecoding's dynamic branch count) and ``draft_tree`` (EAGLE-2's dynamic tree).

Contract: tokens are drawn from the logits the layers below evaluate, by the sampler given
(a keyed sampler at each token's position in the whole sequence); drafted nodes stay pending
until ``commit`` or ``append``. ``RuntimeUsageError``, ``Interrupted`` and ``DraftResult``
are importable from here, as before the split.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from hetspec.protocol import worker_messages as m
from hetspec.protocol.sampling import TokenLogprob
from hetspec.speculative.constrain.constraint import Constraint
from hetspec.speculative.drafting.branching import branch_length, uncertainty_branches
from hetspec.speculative.drafting.dynamic_tree import child_scores, rank_nodes, within_leaves
from hetspec.speculative.verify.distributions import SamplingParams, distribution, top_tokens
from hetspec.speculative.verify.samplers import KeyedSampler, Sampler, pick, proposals
from hetspec.speculative.verify.tree import ROOT
from hetspec.workers.runtimes.decode_steps import DecodeSteps
from hetspec.workers.runtimes.one_call_drafts import DraftResult, OneCallDrafts
from hetspec.workers.runtimes.pending_tree import Interrupted, Output, RuntimeUsageError

__all__ = ["DraftResult", "Interrupted", "RuntimeUsageError", "TreeDraftResult", "TreeRuntime"]


@dataclass(frozen=True)
class TreeDraftResult:
    """A dynamic tree draft: its nodes ranked best first, each parent before its children."""

    tokens: np.ndarray  # (n,) int64
    parents: np.ndarray  # (n,) int64: an earlier node of this list, or -1 (the committed end)
    acceptance: np.ndarray  # (n,) float64: each node's score, its estimated chance of acceptance
    nodes: np.ndarray  # (n,) the pending-tree node of each, -1 where not evaluated


class TreeRuntime(OneCallDrafts[Output]):
    """A ``PendingTree`` (see there: the committed sequence, the pending tree and its hooks)
    that chooses tokens: decodes alone, drafts branches and trees."""

    def decode(
        self,
        steps: int,
        params: SamplingParams,
        sampler: Sampler,
        *,
        logprobs: list[TokenLogprob] | None = None,
        top: int = 0,
        grammar: Constraint | None = None,
        ends: Collection[int] = (),
    ) -> list[int]:
        """Decode alone: draw ``steps`` tokens after the committed sequence, one forward each,
        committing every token but the last as it is drawn (the last is drawn, not evaluated);
        fewer where one of ``ends`` is drawn (then the last: nothing after it is emitted).
        Greedy draws take the argmax of the logits, as ``verify_greedy`` does. The cheapest
        way to decode: no pending tree and no probability rows. Given a ``logprobs`` list,
        each drawn token's log-probability (and ``top`` alternatives) is appended to it.
        ``grammar`` (at the committed sequence's state): each token is drawn from the logits
        masked by it, and advances it.

        A token's position (for a keyed ``sampler``) is its index in the whole sequence, here
        and in ``draft``: the first token after the committed ones is at ``committed``."""
        decoding = DecodeSteps(
            steps, params, sampler, logprobs=logprobs, top=top, grammar=grammar, ends=ends
        )
        self.discard_pending()
        logits = self.last_logits()
        while decoding.draw(logits, self.committed):
            token = decoding.drawn[-1]
            # append() without its pending-tree matching: ~6% of a demo-target token
            logits = self._extend_committed(self._checked_tokens([token], 1))
            self._last_logits = logits
            self.tokens.append(token)
        return decoding.drawn

    def draft(
        self,
        steps: int,
        params: SamplingParams,
        sampler: Sampler,
        *,
        branches: int = 1,
        out: np.ndarray | None = None,
        after: tuple[int, int] | None = None,
        dynamic: float | None = None,
        first: int | None = None,
        grammar: Constraint | None = None,
    ) -> DraftResult:
        """Draft ``branches`` continuations of ``steps`` tokens each, one forward per step.

        With ``dynamic`` (a threshold scale), DuoDecoding's rule picks the branch count: up to
        ``branches`` sequences sharing a budget of ``steps`` tokens (see ``_draft_dynamic``).

        Branch first tokens are the top-``branches`` tokens when greedy, else the sampler's
        ``candidates`` (independent draws, or a keyed choice and its runners-up). ``out``
        (branches, steps, vocab) float32 receives the probability rows (e.g. a shared-memory
        slot); one is allocated when not given. The drafted nodes stay pending: commit the
        accepted part with ``append`` or ``commit``.

        ``after`` = (parent, token) continues a pending draft instead of starting afresh:
        ``token`` (a drafted token not evaluated yet) is evaluated as a child of pending node
        ``parent`` (ROOT: the committed end), the pending tree is kept, and the branches grow
        below it. This is how a drafter runs ahead while its last draft is being verified.

        ``first`` (the token ``catch_up`` left) is appended first, its forward the one whose
        logits the first step draws from: inside the call that drafts a one-branch chain
        where the runtime has one (``_run_chain``), else as ``append`` would.

        ``grammar`` (at the committed sequence's state, after ``first``): one chain, each
        token drawn from the rows masked by the grammar after the tokens before it (the rows
        reported are those masked ones); the grammar is left after the drafted tokens.
        """
        self._check_draft(
            steps, branches, after, first, constrained=grammar is not None, dynamic=dynamic
        )
        one_call = grammar is None and self.chains_in_one_call(params, branches, dynamic)
        if first is not None and not one_call:
            self.append([first])
            first = None
        if dynamic is not None and after is None:
            return self._draft_dynamic(steps, params, sampler, min(branches, steps), dynamic)
        shape = (branches, steps, self.vocab_size)
        if out is None:
            out = np.empty(shape, np.float32)
        elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise RuntimeUsageError(f"out must be C-contiguous float32 {shape}, not {out.shape}")
        if first is not None:
            return self._draft_after(first, steps, params, sampler, out)
        if after is not None and one_call:
            return self._draft_below(after, steps, params, sampler, out)
        if after is None:
            first_logits = self.last_logits()
            self.discard_pending()
            root, position = ROOT, self.committed
        else:
            output = self.forward_tree([after[1]], [after[0]], extend=True)
            first_logits = self._step_logits(output)[0]
            root = self.pending - 1
            position = self.committed + int(self._pending_depths[root]) + 1
        tokens = np.empty((branches, steps), np.int64)
        nodes = np.full((branches, steps), -1, np.int64)
        if grammar is not None:
            first_logits = grammar.masked(first_logits)
        distribution(first_logits, params, out=out[0, 0])
        out[1:, 0] = out[0, 0]
        tokens[:, 0] = proposals(out[0, 0], params, sampler, position, branches)
        result = DraftResult(tokens, out, nodes, root)
        if (
            steps > 1
            and grammar is None
            and (
                self._draft_chained(result, position, params, sampler)
                or self._draft_branched(result, params)
            )
        ):
            return result
        return self._draft_steps(result, position, params, sampler, grammar)

    def _check_draft(
        self,
        steps: int,
        branches: int,
        after: tuple[int, int] | None,
        first: int | None,
        *,
        constrained: bool,
        dynamic: float | None,
    ) -> None:
        """Refuse a draft ``draft`` cannot make: a grammar's is one chain from the committed
        end, drawn step by step."""
        if steps < 1 or not 1 <= branches <= self.vocab_size:
            raise RuntimeUsageError(f"cannot draft {branches} branches of {steps} steps")
        if first is not None and after is not None:
            raise RuntimeUsageError("a draft continues a pending one or appends, not both")
        if constrained and (branches > 1 or after is not None or dynamic is not None):
            raise RuntimeUsageError("a draft under a grammar is one chain from the committed end")

    def _draft_steps(
        self,
        result: DraftResult,
        position: int,
        params: SamplingParams,
        sampler: Sampler,
        grammar: Constraint | None,
    ) -> DraftResult:
        """A draft's steps after its first tokens, one forward each (see ``draft``)."""
        tokens, out, nodes, root = result.tokens, result.probs, result.nodes, result.root
        branches, steps = tokens.shape
        for step in range(1, steps):
            parents = nodes[:, step - 2] if step > 1 else np.full(branches, root)
            nodes[:, step - 1] = self.pending + np.arange(branches)
            output = self.forward_tree(tokens[:, step - 1], parents, extend=True)
            logits = self._step_logits(output)
            if grammar is not None:  # one chain: its next row, after the token drafted last
                grammar.try_advance(int(tokens[0, step - 1]))  # not past its end
                logits = grammar.masked(logits[0])[None]
            distribution(logits, params, out=out[:, step])
            tokens[:, step] = pick(out[:, step], params, sampler, position + step)
        return result

    def draft_shape(
        self,
        shape: m.DraftShape,
        params: SamplingParams,
        sampler: Sampler,
        *,
        rows: Callable[[tuple[int, ...]], np.ndarray] | None = None,
        first: int | None = None,
        grammar: Constraint | None = None,
    ) -> DraftResult | TreeDraftResult:
        """Draft one of the four shapes a ``Draft`` command carries (``draft`` or
        ``draft_tree`` underneath). ``rows(shape)``: the array the probability rows go to (a
        shared-memory slot), where the shape fixes them before drafting; a rule's shape is
        known only once drafted (its rows are the result's own). ``first`` and ``grammar``:
        as ``draft``'s, for a chain (a grammar takes no other shape)."""
        out = None
        if grammar is not None and not isinstance(shape, m.Chains):
            raise RuntimeUsageError(f"a draft under a grammar is a chain, not {shape!r}")
        match shape:
            case m.DynamicTree(depth, top_k, size, first_accept):
                return self.draft_tree(
                    depth, top_k, size, params, sampler, first_accept=first_accept
                )
            case m.Chains(steps, branches):
                out = rows((branches, steps, self.vocab_size)) if rows else None
                return self.draft(
                    steps,
                    params,
                    sampler,
                    branches=branches,
                    out=out,
                    first=first,
                    grammar=grammar,
                )
            case m.RunAhead(node, token, steps):
                out = rows((1, steps, self.vocab_size)) if rows else None
                return self.draft(steps, params, sampler, out=out, after=(node, token))
            case m.RuleBranches(budget, most, scale):
                return self.draft(budget, params, sampler, branches=most, dynamic=scale)
        raise RuntimeUsageError(f"not a draft shape: {shape!r}")

    def draft_tree(
        self,
        depth: int,
        top_k: int,
        size: int,
        params: SamplingParams,
        sampler: Sampler,
        *,
        first_accept: float | None = None,
    ) -> TreeDraftResult:
        """EAGLE-2's dynamic tree from the committed end (``speculative.dynamic_tree``):
        ``depth`` layers, each expanding the ``top_k`` likeliest nodes of the layer before into
        their ``top_k`` likeliest children (one forward per layer after the first); then the
        ``size`` likeliest drafted nodes, ranked. Likeliest: by the draft's path probability,
        or with ``first_accept`` by the acceptance model of ``dynamic_tree.child_scores``.

        Children are chosen, not drawn: the best tokens of the draft's distribution, or for a
        keyed sampler the best of its keyed scores (the target's own choice is the best of
        those): for greedy and keyed verification, which accept whatever tree they get."""
        if depth < 1 or not 1 <= top_k <= self.vocab_size or size < 1:
            raise RuntimeUsageError(
                f"cannot draft a tree of depth {depth}, {top_k} children a node and {size} nodes"
            )
        first = distribution(self.last_logits(), params)
        self.discard_pending()
        position = self.committed
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        layers: list[int] = []
        nodes: list[int] = []

        def grow(row: np.ndarray, parent: int, at: int, layer: int) -> list[int]:
            if isinstance(sampler, KeyedSampler) and not params.greedy:
                chosen = sampler.candidates(row, at, top_k)
            else:
                chosen = top_tokens(row, top_k)
            base = scores[parent] if parent != ROOT else 0.0
            added = []
            for token, score in zip(
                chosen.tolist(), child_scores(row, chosen, first_accept), strict=True
            ):
                if row[token] <= 0:  # outside the warped distribution: never accepted
                    continue
                added.append(len(tokens))
                tokens.append(int(token))
                parents.append(parent)
                scores.append(base + float(score))
                layers.append(layer)
                nodes.append(-1)
            return added

        layer = grow(first, ROOT, position, 0)
        for level in range(1, depth):
            expand = sorted(layer, key=lambda node: -scores[node])[:top_k]
            below = [nodes[parents[node]] if parents[node] != ROOT else ROOT for node in expand]
            # a runtime holding only so many leaves gets the likeliest expansions that fit
            fits = within_leaves([*self._pending_parents.tolist(), *below], self.max_leaves)
            expand, below = expand[: fits - self.pending], below[: fits - self.pending]
            if not expand:
                break
            start = self.pending
            output = self.forward_tree([tokens[node] for node in expand], below, extend=True)
            rows = distribution(self._step_logits(output), params)
            layer = []
            for row, node in enumerate(expand):
                nodes[node] = start + row
                layer += grow(rows[row], node, position + level, level)
        order, ranked_parents = rank_nodes(parents, scores, layers, size)
        return TreeDraftResult(
            np.asarray(tokens, np.int64)[order],
            ranked_parents,
            np.exp(np.asarray(scores, np.float64)[order]),
            np.asarray(nodes, np.int64)[order],
        )

    def _draft_dynamic(
        self, budget: int, params: SamplingParams, sampler: Sampler, cap: int, scale: float
    ) -> DraftResult:
        """DuoDecoding's dynamic multi-sequence draft from the committed end.

        The top (greedy) or drawn first token is evaluated first: its continuation's top
        probability decides k (``uncertainty_branches``). The other k - 1 sequences start from
        the next candidates (greedy: the next best; sampling: the sampler's, as for fixed
        branches, which keeps multi-candidate verification lossless whatever k is) and all
        grow to ``budget // k`` tokens, the first sequence one forward ahead of the rest.
        Branching costs one forward more than a fixed draft of the same shape; not branching
        costs nothing more."""
        vocab = self.vocab_size
        first = distribution(self.last_logits(), params)
        self.discard_pending()
        position = self.committed
        top = int(pick(first, params, sampler, position)[0])
        second = distribution(self._step_logits(self.forward_tree([top], [ROOT]))[0], params)
        k = uncertainty_branches(first, float(second.max()), cap, scale)
        length = branch_length(budget, k)
        tokens = np.empty((k, length), np.int64)
        nodes = np.full((k, length), -1, np.int64)
        out = np.empty((k, length, vocab), np.float32)
        out[:, 0] = first
        tokens[0, 0], nodes[0, 0] = top, 0
        if k > 1:
            # greedy and keyed: the runners-up of ``top``; drawn: independent draws
            tokens[1:, 0] = proposals(first, params, sampler, position, k)[1:]
        if length > 1:
            out[0, 1] = second
            tokens[0, 1] = pick(second, params, sampler, position + 1)[0]
        evaluated = np.array([1] + [0] * (k - 1))  # positions evaluated so far, per sequence
        while True:
            grow = [b for b in range(k) if evaluated[b] < length - 1]
            if not grow:
                break
            positions = evaluated[grow]
            parents = [
                int(nodes[b, p - 1]) if p else ROOT for b, p in zip(grow, positions, strict=True)
            ]
            start = self.pending
            output = self.forward_tree(tokens[grow, positions], parents, extend=True)
            logits = self._step_logits(output)
            for row, (b, p) in enumerate(zip(grow, positions, strict=True)):
                nodes[b, p] = start + row
                distribution(logits[row], params, out=out[b, p + 1])
                tokens[b, p + 1] = pick(out[b, p + 1], params, sampler, position + p + 1)[0]
            evaluated[grow] += 1
        return DraftResult(tokens, out, nodes, ROOT)

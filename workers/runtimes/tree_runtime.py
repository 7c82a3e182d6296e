"""What both engines share: a committed sequence, a pending token tree, and drafting.

The llama.cpp runtime and the torch runtime keep their keys/values very differently (sequence
ids in llama.cpp's cache, slots of a preallocated tensor in torch), but the bookkeeping above
that is the same and lives here: validating trees, positions and ancestor masks of pending
nodes, committing one path, reusing evaluated nodes when a drafted branch is accepted, rollback,
and the drafting loop. A subclass supplies the hooks that touch its model and cache.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from hetspec.protocol.sampling import TokenLogprob
from hetspec.speculative.drafting.branching import branch_length, uncertainty_branches
from hetspec.speculative.drafting.dynamic_tree import child_scores, rank_nodes, within_leaves
from hetspec.speculative.verify.distributions import SamplingParams, distribution, top_tokens
from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.speculative.verify.samplers import ChainDraws, KeyedSampler, Sampler, pick, proposals
from hetspec.speculative.verify.tree import (
    ROOT,
    ancestor_mask,
    depths,
    is_path,
    match_path,
    validate_parents,
)
from hetspec.speculative.verify.verdicts import RowsOnDemand

Output = TypeVar("Output")
WARM_UP_S = 3.0  # what warming the widths up at load may take (see TreeRuntime.warm_up)


class RuntimeUsageError(ValueError):
    """A call the runtime's state does not allow (context full, not a path, ...)."""


class Interrupted(RuntimeError):
    """Evaluating a prompt stopped between two chunks because ``interrupt`` said so; the
    chunks evaluated before stay committed (a later prefill of the same prompt reuses them)."""


@dataclass(frozen=True)
class DraftResult:
    tokens: np.ndarray  # (branches, steps) int64
    probs: np.ndarray  # (branches, steps, vocab) float32: the distribution each token came from
    # (branches, steps) pending-tree node of each token; -1 for the last step, which is drawn
    # but not evaluated (its keys/values are computed only if it is accepted).
    nodes: np.ndarray
    root: int = -1  # the pending node the branches hang from (-1: the committed end)


@dataclass(frozen=True)
class TreeDraftResult:
    """A dynamic tree draft: its nodes ranked best first, each parent before its children."""

    tokens: np.ndarray  # (n,) int64
    parents: np.ndarray  # (n,) int64: an earlier node of this list, or -1 (the committed end)
    acceptance: np.ndarray  # (n,) float64: each node's score, its estimated chance of acceptance
    nodes: np.ndarray  # (n,) the pending-tree node of each, -1 where not evaluated


class TreeRuntime(ABC, Generic[Output]):
    """A committed token sequence plus a pending tree of evaluated, unconfirmed nodes.

    Pending node i sits at position committed + depth(i) and attends to the whole committed
    prefix and to its own ancestors. ``commit`` keeps one root-to-node path and drops the rest;
    ``rollback`` shortens the committed sequence.
    """

    default_chunk: int = 512
    # True where a ``_run`` output owns its logits (no later forward overwrites them): a
    # committed node's row is then fetched only if the next-token logits are asked for (from
    # a GPU, a copy and a wait that greedy rounds never need)
    outputs_kept: bool = False
    feature_size: int | None = None  # set by runtimes that can report features
    max_leaves: int | None = None  # the most leaves the pending tree may have (None: any)
    # asked between the chunks of a long evaluation: True stops it (Interrupted)
    interrupt: Callable[[], bool] | None = None

    def __init__(self, vocab_size: int, capacity: int) -> None:
        self.vocab_size = vocab_size
        self.capacity = capacity
        # while features are captured, every forward appends its positions' features here
        self.features_sink: list[np.ndarray] | None = None
        self.tokens: list[int] = []  # the committed sequence
        self._last_logits = None
        self.forwards = 0  # forwards run so far (a chain's steps each count), for timing them
        self._reset_pending()

    @property
    def _last_logits(self) -> np.ndarray | None:
        """The next-token logits after tokens[-1] (None: not known yet)."""
        if self._last_cached is None and self._last_node is not None:
            output, index = self._last_node
            self._last_cached, self._last_node = self._node_logits(output, index), None
        return self._last_cached

    @_last_logits.setter
    def _last_logits(self, logits: np.ndarray | None) -> None:
        self._last_cached: np.ndarray | None = logits
        self._last_node: tuple[Output, int] | None = None  # a committed row not fetched yet

    # ------------------------------------------------------------ hooks

    @abstractmethod
    def _run(
        self, tokens: np.ndarray, parents: np.ndarray, positions: np.ndarray, rows: np.ndarray
    ) -> Output:
        """Evaluate new pending nodes (already validated); ``rows`` is their ancestor mask over
        all pending nodes, old and new. Their keys/values must stay until commit or discard."""

    @abstractmethod
    def _node_logits(self, output: Output, index: int) -> np.ndarray:
        """float32 (vocab,) logits of node ``index`` of one ``_run`` output."""

    @abstractmethod
    def _step_logits(self, output: Output) -> np.ndarray:
        """float32 (nodes, vocab) logits of one ``_run`` output, on the CPU."""

    @abstractmethod
    def _keep_path(self, path: list[int]) -> None:
        """Make the cache hold committed + the pending ``path`` only (called before bookkeeping
        changes, so ``committed`` and the pending tree are still the old ones)."""

    @abstractmethod
    def _drop_pending_kv(self) -> None:
        """Remove every pending node's keys/values."""

    @abstractmethod
    def _truncate_kv(self, length: int) -> None:
        """Remove committed keys/values from position ``length`` on (pending already dropped)."""

    @abstractmethod
    def _extend_committed(self, tokens: np.ndarray) -> np.ndarray:
        """Evaluate a chain directly after the committed prefix, with no pending tree, and keep
        it; returns the float32 logits after its last token."""

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

    @contextlib.contextmanager
    def features_captured(self) -> Iterator[list[np.ndarray]]:
        """Collect the features (float32 (rows, feature_size): the hidden state entering the
        LM head) of every position evaluated inside the block, in evaluation order."""
        if self.feature_size is None:
            raise RuntimeUsageError(f"{type(self).__name__} cannot report features")
        self.features_sink = sink = []
        try:
            yield sink
        finally:
            self.features_sink = None

    def _capture(self, rows) -> None:
        if self.features_sink is not None:
            # a copy: llama.cpp reuses its output buffer
            self.features_sink.append(np.array(rows, np.float32).reshape(-1, self.feature_size))

    # ------------------------------------------------------------ state

    @property
    def committed(self) -> int:
        return len(self.tokens)

    @property
    def pending(self) -> int:
        return len(self._pending_tokens)

    def _reset_pending(self) -> None:
        self._pending_tokens = np.zeros(0, np.int64)
        self._pending_parents = np.zeros(0, np.int64)
        self._pending_depths = np.zeros(0, np.int64)
        self._pending_mask = np.zeros((0, 0), bool)
        self._pending_outputs: list[tuple[int, Output]] = []  # (first node, its _run output)

    def discard_pending(self) -> None:
        """Forget the pending tree."""
        if self.pending:
            self._drop_pending_kv()
        self._reset_pending()

    def rollback(self, length: int) -> None:
        """Shorten the committed sequence to ``length`` tokens and drop the pending tree."""
        if not 0 <= length <= self.committed:
            raise RuntimeUsageError(f"cannot roll back to {length}: {self.committed} committed")
        self.discard_pending()
        if length < self.committed:
            self._truncate_kv(length)
            del self.tokens[length:]
            self._last_logits = None

    # the order in which warm_up runs the chain widths up to `width`, and its time budget
    warm_up_s = WARM_UP_S

    def warm_up_widths(self, width: int) -> Iterable[int]:
        return range(1, width + 1)

    def warm_up(self, max_width: int) -> None:
        """Evaluate one chain of each width (in ``warm_up_widths`` order, from 1 up to
        ``max_width``) while ``warm_up_s`` lasts, then forget them all.

        Torch on the CPU prepares its kernels per input shape, so the first forward of each
        tree width costs about three times the next ones (10 ms instead of 3 on the demo
        target; llama.cpp 1.3-1.5x). Left cold, those first rounds tell the budget controller
        that wide trees are dear, and it would never try them again. A large model's wide
        chains cost seconds each (every width took a 1B model 34 s in llama.cpp on two
        cores): the narrow widths, which rounds use most, come first, and the rest stay cold
        rather than delay the start by minutes."""
        self.rollback(0)
        width = min(max_width, self.capacity - 1)
        self.append([0])
        deadline = time.perf_counter() + self.warm_up_s
        for nodes in self.warm_up_widths(width):
            self.forward_tree([0] * nodes, list(range(-1, nodes - 1)))
            self.discard_pending()
            if time.perf_counter() > deadline:
                break
        self.rollback(0)

    def _checked_tokens(self, tokens: Sequence[int], extra_positions: int) -> np.ndarray:
        array = np.asarray(tokens, dtype=np.int64).reshape(-1)
        bad = (array < 0) | (array >= self.vocab_size)
        if bad.any():
            raise RuntimeUsageError(
                f"token id {int(array[bad][0])} outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if self.committed + self.pending + extra_positions > self.capacity:
            raise RuntimeUsageError(
                f"context full: {self.committed} committed + {self.pending + extra_positions} "
                f"more tokens exceed the {self.capacity}-token context"
            )
        return array

    # ------------------------------------------------------------ trees

    def forward_tree(
        self, tokens: Sequence[int], parents: Sequence[int], *, extend: bool = False
    ) -> Output:
        """Evaluate a token tree below the committed prefix; logits for every node.

        ``parents[i]`` is -1 (the last committed token) or the index of an earlier node of this
        call. With ``extend=True`` the nodes join the existing pending tree instead, and parent
        indices count from its first node (existing nodes first).
        """
        if not extend:
            self.discard_pending()
        if len(tokens) == 0:
            raise RuntimeUsageError("a forward needs at least one token")
        if len(parents) != len(tokens):
            raise RuntimeUsageError(f"{len(tokens)} tokens but {len(parents)} parents")
        existing = self.pending
        token_array = self._checked_tokens(tokens, len(tokens))
        parent_array = validate_parents(parents, existing)
        node_depths = depths(parent_array, self._pending_depths)
        rows = ancestor_mask(parent_array, self._pending_mask)
        output = self._run(token_array, parent_array, self.committed + node_depths, rows)
        self.forwards += 1
        self._record_pending(token_array, parent_array, node_depths, rows, output)
        return output

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

    def _record_pending(
        self,
        tokens: np.ndarray,
        parents: np.ndarray,
        node_depths: np.ndarray,
        rows: np.ndarray,
        output: Output,
        *,
        first: int | None = None,
    ) -> None:
        """Add evaluated nodes to the pending tree (``rows``: their ancestor mask); ``first``:
        the node of ``output``'s first row (default: the first new node; -1: a row before
        them, as a committed token's)."""
        existing = self.pending
        mask = np.zeros((existing + len(rows),) * 2, bool)
        mask[:existing, :existing] = self._pending_mask
        mask[existing:] = rows
        self._pending_mask = mask
        self._pending_tokens = np.concatenate([self._pending_tokens, tokens])
        self._pending_parents = np.concatenate([self._pending_parents, parents])
        self._pending_depths = np.concatenate([self._pending_depths, node_depths])
        self._pending_outputs.append((existing if first is None else first, output))

    def evaluate_tree(
        self,
        tokens: Sequence[int],
        parents: Sequence[int],
        *,
        extend: bool = False,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """``forward_tree``, returning the float32 (nodes, vocab) logits on the CPU, written
        into ``out`` (e.g. a shared-memory slot) when given."""
        shape = (len(tokens), self.vocab_size)
        if out is not None and (out.shape != shape or out.dtype != np.float32):
            raise RuntimeUsageError(f"out must be float32 {shape}, not {out.dtype} {out.shape}")
        output = self.forward_tree(tokens, parents, extend=extend)
        if out is None:
            return self._step_logits(output)
        self._write_step_logits(output, out)
        return out

    def evaluate_argmax(
        self, tokens: Sequence[int], parents: Sequence[int], *, extend: bool = False
    ) -> list[int]:
        """``forward_tree``, returning each node's argmax (the first of equal logits), as
        greedy verification takes it, without the logits."""
        return self._step_argmax(self.forward_tree(tokens, parents, extend=extend)).tolist()

    def evaluate_rows(
        self, tokens: Sequence[int], parents: Sequence[int], *, extend: bool = False
    ) -> RowsOnDemand:
        """``forward_tree``, each node's float32 logits brought to the CPU only when first read
        (a sampled verdict reads the rows its walk reaches), until the next forward."""
        output = self.forward_tree(tokens, parents, extend=extend)
        return RowsOnDemand(
            (len(tokens), self.vocab_size), lambda row: self._node_logits(output, row)
        )

    def _step_argmax(self, output: Output) -> np.ndarray:
        """The argmax of each row of ``_step_logits(output)`` (a runtime may skip copying)."""
        return self._step_logits(output).argmax(axis=-1)

    def _write_step_logits(self, output: Output, out: np.ndarray) -> None:
        """Write ``_step_logits(output)`` into ``out`` (a runtime may skip the copy between)."""
        np.copyto(out, self._step_logits(output))

    def pin_host_memory(self, memory: np.ndarray) -> bool:
        """Offer ``memory`` (bytes outputs are often written into, e.g. the shared-memory
        arena) for the runtime's device to copy into directly, until ``close``; whether it
        was taken. The default takes nothing."""
        return False

    def commit(self, nodes: Sequence[int]) -> None:
        """Keep the pending nodes ``nodes`` (one path from the prefix down) and drop the rest."""
        path = [int(node) for node in nodes]
        in_range = all(0 <= node < self.pending for node in path)
        if not (in_range and is_path(path, self._pending_parents)):
            raise RuntimeUsageError(f"nodes {path} are not a path of the pending tree")
        if not path:
            self.discard_pending()
            return
        first, output = next((f, o) for f, o in reversed(self._pending_outputs) if f <= path[-1])
        if self.outputs_kept:
            self._last_logits = None  # (which also forgets any row not fetched yet)
            self._last_node = (output, path[-1] - first)
        else:
            self._last_logits = self._node_logits(output, path[-1] - first)
        self._keep_path(path)
        self.tokens.extend(int(t) for t in self._pending_tokens[path])
        self._reset_pending()

    # ------------------------------------------------------------ sequences

    def append(self, tokens: Sequence[int], chunk_size: int | None = None) -> None:
        """Make ``tokens`` follow the committed sequence, reusing matching pending nodes.

        What the pending tree already evaluated along ``tokens`` (a draft branch that was
        accepted) is committed without recomputation; the rest is evaluated in chunks.
        """
        sequence = [int(token) for token in tokens]
        matched = match_path(self._pending_tokens, self._pending_parents, sequence)
        self.commit(matched)
        self._extend(sequence[len(matched) :], chunk_size)

    def catch_up(self, tokens: Sequence[int]) -> int | None:
        """``append`` all of ``tokens`` but the last one it would evaluate, which it returns
        for ``draft(first=...)`` to evaluate in its first forward; None where every token
        matched a pending node (all committed, nothing left to evaluate)."""
        sequence = [int(token) for token in tokens]
        matched = match_path(self._pending_tokens, self._pending_parents, sequence)
        self.commit(matched)
        rest = sequence[len(matched) :]
        if not rest:
            return None
        self._extend(rest[:-1])
        return rest[-1]

    def _extend(self, tokens: Sequence[int], chunk_size: int | None = None) -> None:
        """Evaluate ``tokens`` after the committed ones, with no pending tree, and keep them."""
        if not len(tokens):
            return
        rest = self._checked_tokens(tokens, len(tokens))
        size = chunk_size or self.default_chunk
        for begin in range(0, len(rest), size):
            if begin and self.interrupt is not None and self.interrupt():
                raise Interrupted(f"stopped after {begin} of {len(rest)} tokens")
            chunk = rest[begin : begin + size]
            self._last_logits = self._extend_committed(chunk)
            self.forwards += 1
            self.tokens.extend(chunk.tolist())

    def prefill(self, prompt: Sequence[int], chunk_size: int | None = None) -> int:
        """Make the committed sequence exactly ``prompt``; returns how many tokens were reused.

        The longest common prefix with what is committed stays in the cache (a chat's earlier
        turns); at least one token is re-evaluated so the next-token logits are fresh.
        """
        common = self._rollback_to_common_prefix(prompt)
        self.append(prompt[common:], chunk_size)
        return common

    def _rollback_to_common_prefix(self, prompt: Sequence[int]) -> int:
        """Roll back to the longest prefix shared with ``prompt`` but its last token; its length."""
        if not len(prompt):
            raise RuntimeUsageError("the prompt is empty")
        common = 0
        for mine, theirs in zip(self.tokens, prompt, strict=False):
            if mine != theirs:
                break
            common += 1
        common = min(common, len(prompt) - 1)
        self.rollback(common)
        return common

    # ------------------------------------------------------------ drafting

    def last_logits(self) -> np.ndarray:
        """float32 logits (vocab,) of the token after the committed sequence."""
        if self._last_logits is None:
            if not self.tokens:
                raise RuntimeUsageError("nothing committed yet: prefill a prompt first")
            last = self.tokens[-1]
            self.rollback(self.committed - 1)
            self.append([last])
        return self._last_logits

    def decode(
        self,
        steps: int,
        params: SamplingParams,
        sampler: Sampler,
        *,
        logprobs: list[TokenLogprob] | None = None,
        top: int = 0,
    ) -> list[int]:
        """Decode alone: draw ``steps`` tokens after the committed sequence, one forward each,
        committing every token but the last as it is drawn (the last is drawn, not evaluated).
        Greedy draws take the argmax of the logits, as ``verify_greedy`` does. The cheapest
        way to decode: no pending tree and no probability rows. Given a ``logprobs`` list,
        each drawn token's log-probability (and ``top`` alternatives) is appended to it.

        A token's position (for a keyed ``sampler``) is its index in the whole sequence, here
        and in ``draft``: the first token after the committed ones is at ``committed``."""
        if steps < 1:
            raise RuntimeUsageError(f"cannot decode {steps} tokens")
        self.discard_pending()
        drawn: list[int] = []
        logits = self.last_logits()
        while True:
            if params.greedy:
                token = int(logits.argmax())
            else:
                token = int(sampler.choose(distribution(logits[None], params), self.committed)[0])
            drawn.append(token)
            if logprobs is not None:
                logprobs.append(token_logprob(logits, token, top))
            if len(drawn) == steps:
                return drawn
            # append() without its pending-tree matching: ~6% of a demo-target token
            logits = self._extend_committed(self._checked_tokens([token], 1))
            self._last_logits = logits
            self.tokens.append(token)

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
        """
        if steps < 1 or not 1 <= branches <= self.vocab_size:
            raise RuntimeUsageError(f"cannot draft {branches} branches of {steps} steps")
        if first is not None and after is not None:
            raise RuntimeUsageError("a draft continues a pending one or appends, not both")
        one_call = self.chains_in_one_call(params, branches, dynamic)
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
        distribution(first_logits, params, out=out[0, 0])
        out[1:, 0] = out[0, 0]
        tokens[:, 0] = proposals(out[0, 0], params, sampler, position, branches)
        result = DraftResult(tokens, out, nodes, root)
        if steps > 1 and (
            self._draft_chained(result, position, params, sampler)
            or self._draft_branched(result, params)
        ):
            return result
        for step in range(1, steps):
            parents = nodes[:, step - 2] if step > 1 else np.full(branches, root)
            nodes[:, step - 1] = self.pending + np.arange(branches)
            output = self.forward_tree(tokens[:, step - 1], parents, extend=True)
            distribution(self._step_logits(output), params, out=out[:, step])
            tokens[:, step] = pick(out[:, step], params, sampler, position + step)
        return result

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


def _chain_rows(
    rows: np.ndarray, probs: np.ndarray | None, logits: np.ndarray, params: SamplingParams
) -> None:
    """A chain call's probability rows into ``rows``: those it returned (the rows its tokens
    were drawn from, as verification needs), or the distribution of its ``logits``."""
    if probs is None:
        distribution(logits, params, out=rows)
    elif probs is not rows:
        rows[...] = probs

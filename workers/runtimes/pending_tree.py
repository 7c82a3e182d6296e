"""A committed token sequence plus a pending tree of evaluated, unconfirmed nodes: what both
engines keep, and how they evaluate, without choosing a single token.

The llama.cpp runtime and the torch runtime keep their keys/values very differently (sequence
ids in llama.cpp's cache, slots of a preallocated tensor in torch), but the bookkeeping above
that is the same and lives here: validating trees, positions and ancestor masks of pending
nodes, committing one path, reusing evaluated nodes when a drafted branch is accepted (in
``append`` and ``prefill``), rollback, warming up, capturing features. A subclass supplies
the hooks that touch its model and cache.

Contract: ``PendingTree`` evaluates what it is given and keeps what it is told to; it never
draws, samples or drafts (``one_call_drafts`` and ``tree_runtime`` build that on it). Calls
its state does not allow raise ``RuntimeUsageError``; a long evaluation that ``interrupt``
stops raises ``Interrupted``.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np

from hetspec.protocol.sampling import TokenLogprob
from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.speculative.verify.tree import (
    ancestor_mask,
    depths,
    is_path,
    match_path,
    validate_parents,
)
from hetspec.speculative.verify.verdicts import RowsOnDemand

Output = TypeVar("Output")
WARM_UP_S = 3.0  # what warming the widths up at load may take (see PendingTree.warm_up)


class RuntimeUsageError(ValueError):
    """A call the runtime's state does not allow (context full, not a path, ...)."""


class Interrupted(RuntimeError):
    """Evaluating a prompt stopped between two chunks because ``interrupt`` said so; the
    chunks evaluated before stay committed (a later prefill of the same prompt reuses them)."""


class PendingTree(ABC, Generic[Output]):
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
        common, rest = self.start_prefill(prompt)
        self._extend(rest, chunk_size)
        return common

    def start_prefill(self, prompt: Sequence[int]) -> tuple[int, list[int]]:
        """``prefill``'s first half, for a caller that evaluates the rest itself (in chunks,
        beside other sequences' work): roll back to the longest common prefix, check that the
        rest is made of vocabulary ids and fits the context; returns how many tokens were
        reused and the tokens left to evaluate (at least one)."""
        common = self._rollback_to_common_prefix(prompt)
        rest = [int(token) for token in prompt[common:]]
        self._checked_tokens(rest, len(rest))
        return common, rest

    def prompt_logprobs(
        self, prompt: Sequence[int], top: int = 0, chunk_size: int = 256
    ) -> list[TokenLogprob]:
        """Make the committed sequence exactly ``prompt``, evaluated afresh (nothing reused:
        every position's logits are needed), and return each token's log-probability after
        the first under the logits of the tokens before it, with ``top`` alternatives.

        The tokens after the first are evaluated as chains of ``chunk_size`` pending nodes
        (every runtime returns all of a tree's rows), each committed once its rows are read,
        so no more than ``chunk_size`` rows are held at once."""
        if not len(prompt):
            raise RuntimeUsageError("the prompt is empty")
        tokens = [int(token) for token in prompt]
        self.rollback(0)
        self._checked_tokens(tokens, len(tokens))
        self._extend(tokens[:1])
        logprobs: list[TokenLogprob] = []
        for begin in range(1, len(tokens), chunk_size):
            if begin > 1 and self.interrupt is not None and self.interrupt():
                raise Interrupted(f"stopped after {begin} of {len(tokens)} tokens")
            chunk = tokens[begin : begin + chunk_size]
            # read before the forward, which may reuse the buffer it lies in
            logprobs.append(token_logprob(self.last_logits(), chunk[0], top))
            rows = self.evaluate_tree(chunk, list(range(-1, len(chunk) - 1)))
            logprobs += [token_logprob(rows[i - 1], chunk[i], top) for i in range(1, len(chunk))]
            self.commit(range(len(chunk)))  # its last row becomes the next-token logits
        return logprobs

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

    def last_logits(self) -> np.ndarray:
        """float32 logits (vocab,) of the token after the committed sequence."""
        if self._last_logits is None:
            if not self.tokens:
                raise RuntimeUsageError("nothing committed yet: prefill a prompt first")
            last = self.tokens[-1]
            self.rollback(self.committed - 1)
            self.append([last])
        return self._last_logits

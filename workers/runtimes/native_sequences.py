"""Several sequences on one native model: a range of its KV cache each, verified together.

The first stage of serving several requests at once (issue #72), at the runtime level:

- ``SlotRanges`` hands out ranges of one ``NativeModel``'s cache slots, first fit.
- ``NativeSequence`` is a ``TreeRuntime`` in one range: its committed tokens in the range's
  first slots, its pending tree after them, exactly as ``NativeRuntime`` lays out the whole
  cache (``NativeRuntime`` is the sequence that owns all of it). On its own it prefills,
  appends, evaluates trees, commits, rolls back and decodes as any ``TreeRuntime``.
- ``NativeSequences`` owns the model and its ranges: ``open`` a sequence (a range sized to its
  context), ``evaluate`` several sequences' trees and prompt chunks in one forward, ``close``.
  A worker serving several sequences (``Load.sequences``) is a ``NativeRuntime`` at slot 0
  (``adopt``-ed) and ``NativeSequence``s after it, each a range of ``n_ctx`` slots.

Contract: a row evaluated in ``evaluate`` has bit for bit the logits (and writes bit for bit
the keys and values) it has when its sequence evaluates it on its own, whatever else shares the
forward: output does not depend on load. Nothing is shared between sequences but the weights
and the forward: each row attends to its own sequence's slots only. ``evaluate`` leaves each
sequence as its own ``evaluate_tree`` (a tree) or ``append`` of new tokens (a chunk) would.
Every sequence drafts a chain (or branches side by side) in one call of the draft loops
(``hs_draft_chain``), which see the cache's first range as their prefix and another's committed
slots listed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hetspec.native.kernels import BEST
from hetspec.native.model import NativeModel, SequenceRows
from hetspec.speculative.verify.samplers import ChainDraws
from hetspec.speculative.verify.tree import ancestor_mask, depths, validate_parents
from hetspec.workers.runtimes.sequence_work import Chunk, Tree
from hetspec.workers.runtimes.tree_runtime import RuntimeUsageError, TreeRuntime

__all__ = ["Chunk", "NativeSequence", "NativeSequences", "SlotRanges", "Tree"]


class SlotRanges:
    """Free ranges of ``capacity`` cache slots: ``allocate`` the first that fits, ``release``
    it again (merged with free neighbours)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []

    def allocate(self, size: int) -> int:
        """The first slot of a free range of ``size`` slots, now taken; ``RuntimeUsageError``
        where no free range is that long."""
        if size < 1:
            raise RuntimeUsageError(f"cannot allocate {size} slots")
        for index, (start, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[index]
                else:
                    self._free[index] = (start + size, length - size)
                return start
        raise RuntimeUsageError(
            f"no {size} free slots in a row: {self.free} of {self.capacity} free, "
            f"the longest run {self.longest}"
        )

    def release(self, start: int, size: int) -> None:
        """Give back slots start..start+size-1, which ``allocate`` handed out."""
        index = bisect.bisect(self._free, (start, size))
        before = self._free[index - 1] if index else None
        after = self._free[index] if index < len(self._free) else None
        if (
            size < 1
            or start < 0
            or start + size > self.capacity
            or (before and before[0] + before[1] > start)
            or (after and start + size > after[0])
        ):
            raise RuntimeUsageError(f"slots {start}..{start + size - 1} are not taken")
        if after and start + size == after[0]:
            size += after[1]
            del self._free[index]
        if before and before[0] + before[1] == start:
            self._free[index - 1] = (before[0], before[1] + size)
        else:
            self._free.insert(index, (start, size))

    @property
    def free(self) -> int:
        return sum(length for _, length in self._free)

    @property
    def longest(self) -> int:
        return max((length for _, length in self._free), default=0)


class NativeSequence(TreeRuntime[np.ndarray]):
    """A committed sequence and its pending tree in cache slots base..base+capacity-1 of
    ``model``: committed tokens from ``base`` on, pending nodes after them in evaluation order;
    committing a path copies its slots right after the committed ones. Each new node attends to
    the committed slots and its ancestors' slots (listed per node, no dense mask)."""

    def __init__(self, model: NativeModel, base: int, capacity: int, threads: int) -> None:
        if base < 0 or capacity < 1 or base + capacity > model.capacity:
            raise RuntimeUsageError(
                f"slots {base}..{base + capacity - 1} are not in the {model.capacity}-slot cache"
            )
        self.model = model
        self.base = base
        self.threads = threads
        self._extra_threads = 0
        self.closed = False  # its slots given back: it must not write them again
        super().__init__(model.vocab, capacity)

    def set_extra_threads(self, extra: int) -> None:
        """Compute with ``extra`` threads beyond the configured ones (on cores lent for now:
        see workers/runtimes/spare_cores.py); 0 restores the configured count."""
        self._extra_threads = extra

    def _rows(
        self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, first_logit: int
    ) -> SequenceRows:
        """New nodes in the slots after the pending ones, as the kernels take them; ``rows``
        (new, pending + new) says which pending slots each sees besides the committed ones."""
        if self.closed:
            raise RuntimeUsageError("this sequence was closed: its slots may be another's now")
        node, column = np.nonzero(rows)  # row-major: each node's slots in increasing order
        offsets = np.zeros(len(tokens) + 1, np.int32)
        np.cumsum(np.bincount(node, minlength=len(tokens)), out=offsets[1:])
        first_pending = self.base + self.committed
        return SequenceRows(
            tokens,
            positions,
            self.base,
            self.committed,
            first_pending + self.pending,
            offsets,
            first_pending + column,
            first_logit,
        )

    def _visible(self, pending: np.ndarray) -> tuple[int, np.ndarray]:
        """What a draft loop's first node sees besides its own chain, as the kernels take it:
        slots 0..prefix-1 and ``base``: the committed slots and the ``pending`` ones (indices
        among the pending nodes). The cache's first range is its prefix; another lists them."""
        first_pending = self.base + self.committed
        if self.base == 0:
            return self.committed, first_pending + pending
        committed = np.arange(self.base, first_pending, dtype=np.int64)
        return 0, np.concatenate([committed, first_pending + pending])

    def _run_chain(
        self,
        first: int,
        positions: np.ndarray,
        rows: np.ndarray,
        draws: ChainDraws | None,
        temperature: float,
        *,
        probs_out: np.ndarray | None = None,
    ):
        existing = self.pending  # the first node's pending ancestors, in slot order
        prefix, base = self._visible(np.flatnonzero(rows[0, :existing]))
        return self.model.draft_chain(
            first,
            len(rows),
            position=int(positions[0]),
            start=self.base + self.committed + existing,
            prefix=prefix,
            base=base,
            threads=self.threads + self._extra_threads,
            temperature=temperature,
            noise=None if draws is None else draws.noise,
            uniforms=None if draws is None else draws.uniforms,
            probs=probs_out,
        )

    def _run_branches(
        self,
        firsts: np.ndarray,
        count: int,
        position: int,
        base: np.ndarray,
        probs: np.ndarray | None,
    ):
        prefix, visible = self._visible(base)
        return self.model.draft_branches(
            firsts,
            count,
            position=position,
            start=self.base + self.committed + self.pending,
            prefix=prefix,
            base=visible,
            threads=self.threads + self._extra_threads,
            probs=probs,
        )

    def _forward(
        self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, first_logit: int
    ) -> np.ndarray:
        """``_rows`` evaluated in a forward of their own."""
        part = self._rows(tokens, positions, rows, first_logit)
        return self.model.forward(
            part.tokens,
            part.positions,
            start=part.start,
            prefix=part.prefix,
            offsets=part.offsets,
            visible=part.visible,
            first_logit=first_logit,
            threads=self.threads + self._extra_threads,
            prefix_start=part.prefix_start,
        )

    # ------------------------------------------------------------ what ``evaluate`` splits

    def _plan_tree(
        self, tokens: Sequence[int], parents: Sequence[int], extend: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``forward_tree``'s checks before its forward: the new nodes' tokens, parents, depths
        and ancestor mask (the pending tree dropped first unless ``extend``)."""
        if not extend:
            self.discard_pending()
        if len(tokens) == 0:
            raise RuntimeUsageError("a forward needs at least one token")
        if len(parents) != len(tokens):
            raise RuntimeUsageError(f"{len(tokens)} tokens but {len(parents)} parents")
        token_array = self._checked_tokens(tokens, len(tokens))
        parent_array = validate_parents(parents, self.pending)
        node_depths = depths(parent_array, self._pending_depths)
        return (
            token_array,
            parent_array,
            node_depths,
            ancestor_mask(parent_array, self._pending_mask),
        )

    def _record_tree(self, plan: tuple[np.ndarray, ...], logits: np.ndarray) -> None:
        """Keep the nodes of ``_plan_tree``'s plan, evaluated as ``logits``."""
        self.forwards += 1
        self._record_pending(*plan, logits)

    def _plan_chunk(self, tokens: Sequence[int]) -> np.ndarray:
        """A chunk's tokens, checked, to follow the committed ones (the pending tree dropped)."""
        self.discard_pending()
        if len(tokens) == 0:
            raise RuntimeUsageError("a chunk needs at least one token")
        return self._checked_tokens(tokens, len(tokens))

    def _chunk_rows(self, tokens: np.ndarray) -> SequenceRows:
        count = len(tokens)
        positions = self.committed + np.arange(count)
        return self._rows(tokens, positions, np.tril(np.ones((count, count), bool)), count - 1)

    def _record_chunk(self, tokens: np.ndarray, last_logits: np.ndarray) -> None:
        """Commit a chunk evaluated after the committed tokens, ``last_logits`` its last row's."""
        self._last_logits = last_logits
        self.forwards += 1
        self.tokens.extend(tokens.tolist())

    # ------------------------------------------------------------ TreeRuntime hooks

    def _run(
        self, tokens: np.ndarray, parents: np.ndarray, positions: np.ndarray, rows: np.ndarray
    ) -> np.ndarray:
        return self._forward(tokens, positions, rows, 0)

    def _node_logits(self, output: np.ndarray, index: int) -> np.ndarray:
        return output[index].copy()

    def _step_logits(self, output: np.ndarray) -> np.ndarray:
        return output

    def _keep_path(self, path: list[int]) -> None:
        if path != list(range(len(path))):
            first = self.base + self.committed
            self.model.move_slots(first + np.asarray(path), first)

    def _drop_pending_kv(self) -> None:
        """Nothing to do: pending slots are overwritten by the next forward."""

    def _truncate_kv(self, length: int) -> None:
        """Nothing to do: slots past the committed length are never attended to."""

    def _extend_committed(self, tokens: np.ndarray) -> np.ndarray:
        count = len(tokens)
        rows = np.tril(np.ones((count, count), bool))
        positions = self.committed + np.arange(count)
        return self._forward(tokens, positions, rows, count - 1)[0]


class NativeSequences:
    """One ``NativeModel`` whose cache of ``model.capacity`` slots holds several sequences,
    each in a range of its own, and forwards that evaluate several of them at once.

    What an engine calls: ``open(context)`` for a request (``RuntimeUsageError`` when no range
    that long is free), the sequence's own ``prefill`` (or ``Chunk``s in ``evaluate``, beside
    other sequences' rounds), each round ``sequence.commit(path)`` then one ``evaluate`` of
    every active sequence's ``Tree``, and ``close(sequence)`` when the request ends."""

    def __init__(self, model: NativeModel, threads: int) -> None:
        self.model = model
        self.threads = threads
        self.slots = SlotRanges(model.capacity)
        self._open: dict[int, NativeSequence] = {}  # by base slot

    @classmethod
    def load(
        cls,
        path: str | Path,
        slots: int,
        *,
        threads: int,
        simd: int = BEST,
        pack: bool | None = None,
    ) -> NativeSequences:
        """The model of GGUF file ``path`` (``NativeModel``'s arguments) with a cache of
        ``slots`` slots to share (more than the model's trained context if need be)."""
        return cls(NativeModel(path, slots, simd, pack=pack, shared=True), threads)

    @property
    def sequences(self) -> list[NativeSequence]:
        """The open sequences, by slot."""
        return [self._open[base] for base in sorted(self._open)]

    def open(self, context: int) -> NativeSequence:
        """A new empty sequence of up to ``context`` tokens (committed and pending together),
        at most the model's ``context`` (its trained context, for a shared cache)."""
        if context > self.model.context:
            raise RuntimeUsageError(
                f"a context of {context} tokens is past the model's {self.model.context}"
            )
        base = self.slots.allocate(context)
        sequence = NativeSequence(self.model, base, context, self.threads)
        self._open[base] = sequence
        return sequence

    def adopt(self, sequence: NativeSequence) -> None:
        """Count ``sequence``, built on this model in the first free range (as ``open`` would
        place it: ``NativeRuntime``, the sequence at slot 0), as open here."""
        if sequence.model is not self.model:
            raise RuntimeUsageError("that sequence is on another model")
        base = self.slots.allocate(sequence.capacity)
        if base != sequence.base:
            self.slots.release(base, sequence.capacity)
            raise RuntimeUsageError(
                f"the first free range starts at slot {base}, not the sequence's {sequence.base}"
            )
        self._open[base] = sequence

    def close(self, sequence: NativeSequence) -> None:
        """Give ``sequence``'s slots back; the sequence must not be used after."""
        if self._open.get(sequence.base) is not sequence:
            raise RuntimeUsageError("that sequence is not open here")
        del self._open[sequence.base]
        self.slots.release(sequence.base, sequence.capacity)
        sequence.rollback(0)
        sequence.closed = True

    def evaluate(
        self, work: Sequence[Tree | Chunk], *, threads: int | None = None
    ) -> list[np.ndarray]:
        """Every item's rows in one forward (on ``threads``, default the batch's), at most
        one item a sequence: a ``Tree``'s logits (nodes, vocab), its nodes left pending; a
        ``Chunk``'s logits (vocab,) after its last token, its tokens committed. Each row's
        logits are bit for bit those its sequence gets evaluating it on its own
        (``evaluate_tree``, ``append``). Refusals
        (``RuntimeUsageError``, a tree's ``TreeError``) come before the forward, so nothing is
        evaluated; but as in ``forward_tree``, a ``Tree`` without ``extend`` (or a ``Chunk``)
        checked by then has dropped its sequence's pending tree."""
        if not work:
            raise RuntimeUsageError("nothing to evaluate")
        owners = [item.sequence for item in work]
        for sequence in owners:
            if self._open.get(sequence.base) is not sequence:
                raise RuntimeUsageError("a sequence to evaluate is not open here")
        if len({id(sequence) for sequence in owners}) != len(owners):
            raise RuntimeUsageError("one forward evaluates at most one item a sequence")
        plans, parts = [], []
        for item in work:
            sequence = item.sequence
            if isinstance(item, Tree):
                plan = sequence._plan_tree(item.tokens, item.parents, item.extend)
                positions = sequence.committed + plan[2]
                parts.append(sequence._rows(plan[0], positions, plan[3], 0))
            else:
                plan = sequence._plan_chunk(item.tokens)
                parts.append(sequence._chunk_rows(plan))
            plans.append(plan)
        outputs = self.model.forward_sequences(parts, threads=threads or self.threads)
        results = []
        for item, plan, logits in zip(work, plans, outputs, strict=True):
            if isinstance(item, Tree):
                item.sequence._record_tree(plan, logits)
                results.append(logits)
            else:
                item.sequence._record_chunk(plan, logits[0])
                results.append(logits[0])
        return results

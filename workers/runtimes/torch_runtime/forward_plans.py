"""Which rows each forward of a torch runtime runs, and which cache slots each row sees.

``ForwardPlans`` is the layer of ``TorchRuntime`` above ``TreeRuntime``: it reads the pending
tree (``committed``, ``pending``, each pending node's parent and depth) and cuts the new nodes
of one call into forwards, as ``static_forward.Batch`` values without their tokens:

- ``_split_plan``: split attention's forwards (split_attention.py), None where it is off or a
  row lies too deep for it (counted in ``deep_rows``);
- ``_in_place_batches``: a chain in the cache's order that reads the cache in place, None
  where chains do not, or the nodes are not one chain from the committed end;
- ``_invariant_batches``: width-invariant forwards over at most ``shapes.paths`` gathered
  root-to-node paths;
- ``_bucket_batches``: one forward in the cache's order, masks over its slots.

Contract: a plan computes nothing and changes no state (``deep_rows`` aside); it yields
(rows, batch) pairs, the rows indices into the call's new nodes, in order, each node once,
each batch of one span bucket and at most ``widest`` (or ``most_rows``) rows, but for
``_bucket_batches``' one batch, which its caller keeps within ``widest``. The forwards that
run them and the attributes read here (``_split``, ``_in_place``: ``StaticForward`` or None;
``config``) are ``torch_forwards``'.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from hetspec.workers.runtimes.pending_tree import Output
from hetspec.workers.runtimes.torch_runtime.split_attention import path_tails
from hetspec.workers.runtimes.torch_runtime.static_forward import Batch, Shapes, StaticForward
from hetspec.workers.runtimes.tree_runtime import TreeRuntime


def span_runs(
    shapes: Shapes, positions: np.ndarray, most_rows: int | None = None
) -> Iterator[tuple[np.ndarray, int]]:
    """Rows at ``positions`` in order, in runs of at most ``most_rows`` (None: the widest
    shape) that share a span bucket (their own positions'): (rows, span) each."""
    spans = np.asarray(shapes.spans)
    row_spans = spans[np.searchsorted(spans, positions + 1)]
    most_rows = most_rows or shapes.widest
    begin = 0
    while begin < len(positions):
        end = min(begin + most_rows, len(positions))
        end = begin + int(np.argmax(np.append(row_spans[begin:end], -1) != row_spans[begin]))
        yield np.arange(begin, end), int(row_spans[begin])
        begin = end


class ForwardPlans(TreeRuntime[Output]):
    """``TreeRuntime`` with the plans of the forwards that evaluate new nodes."""

    _split: StaticForward | None
    _in_place: StaticForward | None
    deep_rows: int

    def _split_plan(
        self, positions: np.ndarray, parents: np.ndarray, most_rows: int | None = None
    ) -> Iterator[tuple[np.ndarray, Batch]] | None:
        """Split attention's forwards of new nodes after the pending ones (``_split_batches``);
        None without split attention or where a row is too deep for it."""
        if self._split is None:
            return None
        tails = self._split_tails(positions, parents)
        if tails is None:
            return None
        return self._split_batches(self._split, positions, tails, most_rows)

    def _split_tails(self, positions: np.ndarray, parents: np.ndarray) -> np.ndarray | None:
        """``path_tails`` of new nodes after the pending ones (None, counted in
        ``deep_rows``: a row too deep for split attention)."""
        existing = self.pending
        tails = path_tails(
            self.committed,
            np.concatenate([self._pending_parents[:existing], parents]),
            np.concatenate([self._pending_depths[:existing], positions - self.committed]),
            existing + np.arange(len(positions)),
            self._split.shapes.tail_block,
        )
        if tails is None:
            self.deep_rows += len(positions)
        return tails

    def _split_batches(
        self,
        split: StaticForward,
        positions: np.ndarray,
        tails: np.ndarray,
        most_rows: int | None = None,
    ) -> Iterator[tuple[np.ndarray, Batch]]:
        """Split attention's forwards: rows in order, at most ``widest`` (or ``most_rows``)
        a forward, all of one span bucket (their own positions')."""
        first = self.committed + self.pending
        for rows, span in span_runs(split.shapes, positions, most_rows):
            yield (
                rows,
                Batch(
                    tokens=np.empty(0, np.int64),
                    positions=positions[rows],
                    slots=first + rows,
                    masks=[],
                    span=span,
                    tail_slots=tails[rows],
                ),
            )

    def _in_place_batches(
        self, positions: np.ndarray, parents: np.ndarray, most_rows: int | None = None
    ) -> Iterator[tuple[np.ndarray, Batch]] | None:
        """The in-place forwards of new nodes that extend a chain in the cache's order (the
        target alone, a chain verified after the committed tokens): the batches
        ``_forward_batch`` makes of ``_invariant_batches``' one-path ones, without building
        the gathers and path masks it would drop. None where chains do not attend in place
        or the nodes and the pending ones are not one chain from the committed end."""
        flat, existing, count = self._in_place, self.pending, len(positions)
        if flat is None or not (
            np.array_equal(parents, np.arange(existing - 1, existing + count - 1))
            and np.array_equal(self._pending_parents[:existing], np.arange(-1, existing - 1))
        ):
            return None
        return self._chain_batches(flat, positions, most_rows)

    def _chain_batches(
        self, flat: StaticForward, positions: np.ndarray, most_rows: int | None
    ) -> Iterator[tuple[np.ndarray, Batch]]:
        """``_in_place_batches``' forwards (``span_runs``), each row seeing the slots up to
        its own (within each sliding window)."""
        first = self.committed + self.pending
        for rows, span in span_runs(flat.shapes, positions, most_rows):
            picked, keys = positions[rows, None], np.arange(span)
            seen = keys <= picked
            masks = [
                seen if window is None else seen & (keys > picked - window)
                for window in flat.windows
            ]
            yield (
                rows,
                Batch(
                    tokens=np.empty(0, np.int64),
                    positions=positions[rows],
                    slots=first + rows,
                    masks=masks,
                    span=span,
                ),
            )

    def _bucket_batches(
        self, static: StaticForward, positions: np.ndarray, rows: np.ndarray
    ) -> list[tuple[np.ndarray, Batch]]:
        """One forward in cache order (masks over slots), the narrowest buckets that fit."""
        first = self.committed + self.pending  # the first new node's cache slot
        count = len(positions)
        by_window = self._window_masks(rows, positions, self.pending)
        batch = Batch(
            tokens=np.empty(0, np.int64),
            positions=positions,
            slots=np.arange(first, first + count),
            masks=[by_window[w] for w in static.windows],
            span=static.shapes.span_for(first + count),
        )
        return [(np.arange(count), batch)]

    def _invariant_batches(
        self,
        static: StaticForward,
        positions: np.ndarray,
        parents: np.ndarray,
        most_rows: int | None = None,
    ) -> Iterator[tuple[np.ndarray, Batch]]:
        """Width-invariant forwards (static_forward.py): rows in order, a forward holding at
        most ``widest`` (or ``most_rows``) rows of one span bucket (their own positions') on
        at most ``shapes.paths`` root-to-node paths, each row attending to its path in
        position order. Each forward is made as it is asked for, so a caller may run one
        while the next is made."""
        shapes, committed, existing = static.shapes, self.committed, self.pending
        tree = np.concatenate([self._pending_parents[:existing], parents]).tolist()  # pending + new
        node_positions = np.concatenate(  # of every pending node, existing ones first
            [committed + self._pending_depths[:existing], positions]
        ).tolist()
        spans = np.asarray(shapes.spans)
        row_spans = spans[np.searchsorted(spans, np.asarray(positions) + 1)].tolist()
        most_rows = most_rows or shapes.widest
        chosen: list[int] = []
        leaves: list[int] = []  # each path's deepest node so far (index into ``tree``)
        row_paths: list[int] = []

        def flush() -> tuple[np.ndarray, Batch]:
            span, count = row_spans[chosen[0]], len(chosen)
            gather = np.zeros((len(leaves), span), np.int64)
            gather[:, :committed] = np.arange(committed)
            for path, leaf in enumerate(leaves):
                node = leaf
                while node >= 0:  # slot of each ancestor at its position
                    gather[path, node_positions[node]] = committed + node
                    node = tree[node]
            rows = np.array(chosen)
            picked = positions[rows]
            keys = np.arange(span)
            seen = keys <= picked[:, None]
            on_path = (np.array(row_paths), np.arange(count))
            masks = []
            for window in static.windows:
                mask = np.zeros((shapes.paths, count, span), bool)
                mask[:, :, 0] = True  # a row sees slot 0 only through paths not its own
                mask[on_path] = seen if window is None else seen & (keys > picked[:, None] - window)
                masks.append(mask)
            batch = Batch(
                tokens=np.empty(0, np.int64),
                positions=picked,
                slots=committed + existing + rows,
                masks=masks,
                span=span,
                gather=gather,
                row_paths=on_path[0],
            )
            chosen.clear(), leaves.clear(), row_paths.clear()
            return rows, batch

        for row, span in enumerate(row_spans):
            node = existing + row
            parent = tree[node]
            extends = parent in leaves
            if chosen and (
                row_spans[chosen[0]] != span
                or len(chosen) == most_rows
                or (not extends and len(leaves) == shapes.paths)
            ):
                yield flush()
                extends = False
            if extends:
                path = leaves.index(parent)
                leaves[path] = node
            else:
                path = len(leaves)
                leaves.append(node)
            chosen.append(row)
            row_paths.append(path)
        yield flush()

    def _window_masks(
        self, rows: np.ndarray, positions: np.ndarray, existing: int
    ) -> dict[int | None, np.ndarray]:
        """Per distinct sliding window (None: none), which of the committed + pending + new
        cache slots each new node sees, (n, keys)."""
        n, prefix = len(rows), self.committed
        allowed = np.ones((n, prefix + rows.shape[1]), bool)
        allowed[:, prefix:] = rows
        key_positions = np.concatenate(
            [np.arange(prefix), prefix + self._pending_depths[:existing], positions]
        )
        by_window = {}
        for window in set(self.config.sliding_windows):
            mask = allowed
            if window is not None:  # keys no more than window-1 positions back
                mask = allowed & (key_positions[None, :] > positions[:, None] - window)
            by_window[window] = mask
        return by_window

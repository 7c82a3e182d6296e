"""Fixed-shape forwards of a torch model over its KV cache, replayed as CUDA graphs.

A forward here always runs ``width`` rows (the call's tokens, then padding rows whose keys and
values go to scratch slots past the context) against the first ``span`` cache slots, both
taken from a small set of buckets, so that each (width, span) pair is one shape. On CUDA each
shape is captured once as a graph at load and replayed with a single launch: a small model's
forward is a hundred or more tiny kernels, and launched one by one they, not the GPU, set the
pace.

Width-invariant forwards (``Shapes.paths`` > 0, one fixed width) also make a token's logits
bit-identical whatever it is evaluated with, which keeps a bf16 verifier's greedy output
exactly the bf16 target's own. Three things could otherwise change a token's bits: the
batch's shape (one width, always), the attention span (each token is evaluated in the span
bucket of its own position, whatever else the call holds) and where its keys sit in the cache:
a tree puts its siblings between a node's ancestors, and attention kernels sum over keys in
cache order. So every token attends to its path's keys gathered in position order, ``paths``
paths a forward (a chain is one path), or with ``Shapes.tail_block`` to the cache in place
up to a point its position fixes and to its path's last few keys gathered
(split_attention.py): then a forward holds any number of paths.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from hetspec.workers.runtimes.torch_runtime.config import ModelConfig
from hetspec.workers.runtimes.torch_runtime.split_attention import (
    SplitRows,
    split_bias,
    split_point,
    tail_length,
)

MIN_SPAN = 256  # the narrowest attention span bucket (slots)
COMPILED_SHAPES = 256  # recompilations allowed a compiled forward: one per shape
MAX_BUCKET_WIDTH = 64  # the widest width bucket when widths vary
INVARIANT_PATHS = 4  # tree paths one width-invariant forward gathers
TAIL_BLOCK = 16  # split attention's block: a row's gathered tail is 33-48 keys


@dataclass(frozen=True)
class Shapes:
    """The width and span buckets forwards are padded to (both ascending), and the paths a
    width-invariant forward gathers (0: tokens attend in cache order, widths vary) or, where
    ``tail_block`` > 0, the block of its split attention (one fixed width, no paths)."""

    widths: tuple[int, ...]
    spans: tuple[int, ...]
    paths: int = 0
    tail_block: int = 0

    @classmethod
    def for_context(
        cls, capacity: int, *, fixed_width: int, span_buckets: bool, paths: int = INVARIANT_PATHS
    ) -> Shapes:
        """Width buckets 1, 2, 4 .. 64, or ``fixed_width`` alone (> 0, width-invariant, with
        ``paths`` paths a forward); span buckets 256, 512 .. up to ``capacity`` (or
        ``capacity`` alone)."""
        if paths < 1:
            raise ValueError(f"a forward gathers at least one path, not {paths}")
        if fixed_width > 0:
            widths: tuple[int, ...] = (fixed_width,)
        else:
            widths = tuple(2**i for i in range(MAX_BUCKET_WIDTH.bit_length()))
        spans = [capacity]
        if span_buckets:
            span = MIN_SPAN
            while span < capacity:
                spans.insert(-1, span)
                span *= 2
        return cls(widths, tuple(spans), paths if fixed_width > 0 else 0)

    @property
    def widest(self) -> int:
        return self.widths[-1]

    def split(self) -> Shapes:
        """These widths and spans in split attention's forwards (``TAIL_BLOCK``)."""
        return replace(self, paths=0, tail_block=TAIL_BLOCK)

    def width_for(self, rows: int) -> int:
        """The narrowest width bucket holding ``rows`` (<= ``widest``)."""
        return next(w for w in self.widths if w >= rows)

    def span_for(self, keys: int) -> int:
        """The narrowest span bucket holding ``keys`` cache slots."""
        return next(s for s in self.spans if s >= keys)

    def all(self) -> list[tuple[int, int]]:
        """Every (width, span) shape, widest and longest first (the capture order: later,
        smaller graphs reuse the memory pool of the larger ones)."""
        return sorted(((w, s) for w in self.widths for s in self.spans), reverse=True)


@dataclass(frozen=True)
class Batch:
    """One forward's rows. ``masks``: per distinct sliding window (``StaticForward.windows``
    order), which keys each row sees: (n, k) over cache slots, or with ``gather`` (paths, k)
    (each path's cache slot of every position) (paths, n, k) over positions, a row seeing
    keys only through its own path (``row_paths``). Split forwards (``Shapes.tail_block``)
    take no masks (their forwards make them from the positions) but ``tail_slots`` (n, tail):
    each row's path's cache slots from its split point on (any slot past the row itself)."""

    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    masks: list[np.ndarray]
    span: int
    gather: np.ndarray | None = None
    row_paths: np.ndarray | None = None
    tail_slots: np.ndarray | None = None


class StaticForward:
    """Forwards of ``model`` in fixed shapes; ``run`` returns views of static output buffers
    that the next ``run`` overwrites (clone what must outlive it).

    ``keys``/``values``: the cache, (layers, kv_heads, capacity + widest, head_dim): the slots
    past ``capacity`` take the padding rows' keys/values and are never attended to.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        *,
        keys: torch.Tensor,
        values: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        capacity: int,
        shapes: Shapes,
        graphs: bool,
        compiled: bool = False,
        split_kernel: bool = False,
    ) -> None:
        """``compiled``: forwards through torch.compile (inductor fuses the small kernels
        between the matmuls), compiled at the first call (at load where graphs are captured)
        for every span bucket at once (the span a dynamic dimension) and, on CUDA, captured as
        each shape's graph. ``split_kernel``: split
        attention (``shapes.tail_block``) in split_kernel.py's Triton kernel."""
        self.model, self.config, self.shapes = model, config, shapes
        self.split_kernel = split_kernel
        self._compiled = torch.compile(self._compute) if compiled else None
        self.keys, self.values, self.cos, self.sin = keys, values, cos, sin
        self.capacity = capacity
        self.dtype = keys.dtype
        device = self.device = keys.device
        if keys.shape[2] < capacity + shapes.widest:
            raise ValueError("the cache needs widest scratch slots past its capacity")
        self.windows = sorted(set(config.sliding_windows), key=lambda w: (w is None, w or 0))
        self._window_index = [self.windows.index(w) for w in config.sliding_windows]
        pinned = device.type == "cuda"
        widest, paths, windows = shapes.widest, shapes.paths, len(self.windows)

        def pair(shape, dtype):  # (on the device, its pinned host staging)
            return (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, pin_memory=pinned),
            )

        # tokens, positions, cache slots, row paths: a row each
        self._inputs = pair((4, widest), torch.int64)
        mask_rows = (paths, widest) if paths else (widest,)
        block = shapes.tail_block
        spans = () if block else shapes.spans  # split forwards make their masks
        self._masks = {s: pair((windows, *mask_rows, s), torch.bool) for s in spans}
        self._gather = {s: pair((max(paths, 1), s), torch.int64) for s in shapes.spans}
        self._tail = pair((widest, tail_length(block)), torch.int64) if block else None
        self.logits = torch.zeros((widest, config.vocab_size), dtype=torch.float32, device=device)
        self.hidden = torch.zeros((widest, config.hidden_size), dtype=self.dtype, device=device)
        self._staged = torch.cuda.Event() if pinned else None  # host staging free again
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if graphs and device.type == "cuda":
            self._capture_all()

    # ------------------------------------------------------------ calls

    def run(
        self, batch: Batch, first_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluate ``batch`` (n <= widest rows; its keys/values go to ``batch.slots``).
        Returns (logits float32 (n, vocab), last hidden states (n, hidden)): views valid
        until the next call. ``first_token``: a (1,) int64 tensor on the device that replaces
        the first row's token, so a chain's next token need not visit the host; nothing here
        waits for the device but the staging of the call before."""
        n, span = len(batch.tokens), batch.span
        width = self.shapes.width_for(n)
        if self._staged is not None:
            self._staged.synchronize()  # the last call's copies have left the staging buffers
        inputs, host_inputs = self._inputs
        host = host_inputs.numpy()
        host[0, :n], host[1, :n], host[2, :n] = batch.tokens, batch.positions, batch.slots
        host[3, :n] = 0 if batch.row_paths is None else batch.row_paths
        self._pad_inputs(host, n, width)
        if self._tail is not None:
            tail, host_tail = self._tail
            staged_tail = host_tail.numpy()
            staged_tail[:n] = batch.tail_slots
            staged_tail[n:width] = 0  # padding rows at position 0 see slot 0
            tail.copy_(host_tail, non_blocking=True)
        else:
            masks, host_masks = self._masks[span]
            staged = host_masks.numpy()
            staged[...] = False
            for index, mask in enumerate(batch.masks):
                staged[index, ..., :n, : mask.shape[-1]] = mask
            staged[..., n:width, 0] = True  # padding rows see slot 0: never a row of no keys
            masks.copy_(host_masks, non_blocking=True)
        inputs.copy_(host_inputs, non_blocking=True)
        if first_token is not None:
            inputs[0, :1].copy_(first_token)
        if batch.gather is not None:
            gather, host_gather = self._gather[span]
            staged_gather = host_gather.numpy()
            staged_gather[...] = 0
            staged_gather[: len(batch.gather), : batch.gather.shape[1]] = batch.gather
            gather.copy_(host_gather, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        graph = self.graphs.get((width, span))
        if graph is not None:
            graph.replay()
        else:
            self._forward(width, span)
        return self.logits[:n], self.hidden[:n]

    def _pad_inputs(self, host: np.ndarray, n: int, width: int) -> None:
        host[:, n:width] = 0  # token 0 at position 0, seeing slot 0 through path 0
        host[2, n:width] = self.capacity + np.arange(n, width)  # scratch slots

    def _forward(self, width: int, span: int) -> None:
        gather = self._gather[span][0]
        masks = None if self._tail is not None else self._masks[span][0]
        if self._compiled is None:
            self._compute(width, gather, masks)
            return
        # The span comes in as these tensors' last dimension, marked dynamic: one compiled
        # graph serves every span bucket (a compile each took minutes at load for a model's
        # whole context); each (width, span) is still its own CUDA graph.
        torch._dynamo.maybe_mark_dynamic(gather, 1)
        if masks is not None:
            torch._dynamo.maybe_mark_dynamic(masks, masks.dim() - 1)
        with torch._dynamo.config.patch(recompile_limit=COMPILED_SHAPES):
            self._compiled(width, gather, masks)

    def _compute(self, width: int, gather: torch.Tensor, masks: torch.Tensor | None) -> None:
        """One forward of ``width`` rows from the staged inputs over the span of ``gather``'s
        (paths, span) rows; ``masks`` the span's staged masks (None: split attention)."""
        span = gather.shape[1]
        tokens, positions, slots, row_paths = self._inputs[0][:, :width]
        split = None
        if masks is None:
            block = self.shapes.tail_block
            split = SplitRows(self._tail[0][:width], positions, block, self.split_kernel)
            masks = [
                None if self.split_kernel else split_bias(positions, span, block, window)
                for window in self.windows
            ]
        else:
            masks = masks[..., :width, :]
        paths = (gather, row_paths) if self.shapes.paths else None
        hidden = self.model(
            tokens,
            self.cos[:, positions].to(self.dtype),
            self.sin[:, positions].to(self.dtype),
            cache_keys=self.keys,
            cache_values=self.values,
            start=0,
            masks=[masks[i] for i in self._window_index],
            slots=slots,
            paths=paths,
            split=split,
        )
        self.hidden[:width].copy_(hidden)
        self.logits[:width].copy_(self.model.logits(hidden))

    # ------------------------------------------------------------ graphs

    def _capture_all(self) -> None:
        """Capture every shape, inputs set to padding (scratch slots only), after warm-up
        forwards on a side stream (cuBLAS handles and workspaces are made outside a capture)."""
        inputs, host_inputs = self._inputs
        self._pad_inputs(host_inputs.numpy(), 0, self.shapes.widest)
        inputs.copy_(host_inputs)
        for masks, _ in self._masks.values():
            masks.zero_()
            masks[..., 0] = True
        if self._tail is not None:
            self._tail[0].zero_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for width, span in self.shapes.all():
                self._forward(width, span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for width, span in self.shapes.all():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(width, span)
                self.graphs[(width, span)] = graph
        torch.cuda.synchronize(self.device)


# ------------------------------------------------------------ chains in the cache's order


def in_cache_order(batch: Batch) -> bool:
    """Whether a batch's one path is the cache's own order up to its last row (each
    position's key sits in the slot of that number: the target alone, a chain verified after
    the committed tokens), so its rows may attend to the cache in place, with no gather."""
    if batch.gather is None or len(batch.gather) != 1:
        return False
    top = int(batch.positions.max()) + 1
    return bool(np.array_equal(batch.gather[0, :top], np.arange(top)))


def same_bits_in_place(one_path: StaticForward, in_place: StaticForward, seed: int = 0) -> bool:
    """Whether ``in_place`` (no paths: masks over cache slots) computes the bits of
    ``one_path`` (one gathered path) for chains in the cache's order: the same keys in the same
    order, but the attention kernels see a view of the cache instead of a gathered copy, and
    which kernel runs (so the order it sums in) may depend on that. Checked with random tokens
    at the end of every span bucket, each forward's graph as it will run; the slots it writes
    lie past an empty cache's committed end, so nothing reads them later."""
    shapes = one_path.shapes
    vocab, width = one_path.config.vocab_size, shapes.widest
    rng = np.random.default_rng(seed)
    for span in shapes.spans:
        positions = np.arange(max(0, span - width), span)
        keys = np.arange(span)
        masks = []
        for window in one_path.windows:  # each distinct sliding window, in its masks' order
            seen = keys <= positions[:, None]
            if window is not None:
                seen &= keys > positions[:, None] - window
            masks.append(seen)
        tokens = rng.integers(0, vocab, size=len(positions))
        batch = Batch(tokens=tokens, positions=positions, slots=positions, masks=masks, span=span)
        gathered = Batch(
            tokens=tokens,
            positions=positions,
            slots=positions,
            masks=[mask[None] for mask in masks],
            span=span,
            gather=keys[None].astype(np.int64),
            row_paths=np.zeros(len(positions), np.int64),
        )
        logits, hidden = (out.clone() for out in one_path.run(gathered))
        flat_logits, flat_hidden = in_place.run(batch)
        if not (torch.equal(logits, flat_logits) and torch.equal(hidden, flat_hidden)):
            return False
    return True


def kernel_problem(kernel: StaticForward, arithmetic: StaticForward, seed: int = 0) -> str | None:
    """Why split attention's Triton kernel (``kernel``) cannot serve, checked against the
    torch arithmetic (``arithmetic``, the same shapes) on random tokens at the end of the
    first span bucket: it failed to build or run, or its logits are not finite or stray
    further from the arithmetic's than rounding explains (the two differ in bits, never in
    meaning). None: it serves. The slots written lie past an empty cache's committed end."""
    shapes = kernel.shapes
    span, width = shapes.spans[0], shapes.widest
    positions = np.arange(max(0, span - width), span)
    tokens = np.random.default_rng(seed).integers(0, kernel.config.vocab_size, len(positions))
    tails = split_point(positions, shapes.tail_block)[:, None] + np.arange(
        tail_length(shapes.tail_block)
    )  # each row's split point on: its positions, in their own slots (past it: masked)
    batch = Batch(
        tokens=tokens,
        positions=positions,
        slots=positions,
        masks=[],
        span=span,
        tail_slots=np.minimum(tails, span - 1),
    )
    expected = arithmetic.run(batch)[0].float().clone()
    return strayed(lambda: kernel.run(batch)[0], expected, "logits", "the torch arithmetic's")


def strayed(run, expected: torch.Tensor, what: str, reference: str) -> str | None:
    """Why a kernel cannot serve, judged by its output ``run()`` against ``expected`` (the
    same computed another way, ``reference``): it failed to build or run, or its ``what``
    are not finite or stray further than rounding explains. None: it serves."""
    try:
        out = run().float()
    except Exception as error:  # a kernel this GPU or Triton cannot build
        return failure(error)
    if not torch.isfinite(out).all():
        return f"its {what} are not all finite"
    magnitude = float(expected.abs().max()) or 1.0
    worst = float((out - expected).abs().max())
    if worst > 0.05 * magnitude:  # bf16 rounding moves a value by ~1%; a wrong kernel, by all
        return f"its {what} differ from {reference} by {worst:.3g} (of {magnitude:.3g})"
    return None


def failure(error: Exception) -> str:
    """An exception's kind and first line, for a device line."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__

"""A linear layer for at most 16 rows, in Triton: the weight read once, in a fixed order.

A verifier's forward on CUDA is a stack of matmuls of a few rows against large weights, so
its speed is how fast the weights stream from memory. cuBLAS picks its kernel by the row
count and for 16 rows picks tiles sized for big batches. This kernel is shaped for few rows:
every program reads a ``BLOCK_N x BLOCK_K`` tile of the weight per step for all rows at once,
the K dimension split across ``splits`` programs (chosen from the weight's shape and the GPU's
SM count, never from the row count) and the partial sums added in split order by a second
kernel. A row's result therefore does not depend on the other rows or on how many there are:
it is batch-invariant, as a width-invariant verifier needs.

The weight may also be int8 with one float32 scale per output row (``int8_weights.py``):
each tile is widened to the rows' type in registers (exactly: every int8 is a bfloat16) and
the scale multiplies the finished sum, so the kernel streams half the bytes of bfloat16.

Triton compiles for the GPU; with ``TRITON_INTERPRET=1`` the same kernels run on the CPU
(slowly), which is how the tests check them where there is no GPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import astuple, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from hetspec.workers.runtimes.torch_runtime.static_forward import strayed

MAX_ROWS = 16  # tl.dot's smallest tile: fewer rows are masked, more take another kernel


@dataclass(frozen=True)
class Tiling:
    """How the kernel cuts a weight: tiles of ``block_n`` x ``block_k``, and K split until
    about ``programs_per_sm`` programs per SM are in flight. Anything here may change the
    bits of a result, never with the row count: one tiling serves every call of a model."""

    block_n: int = 64
    block_k: int = 128
    programs_per_sm: int = 4
    warps: int = 4
    stages: int = 4  # at most: fewer where a GPU's shared memory holds fewer (same bits)

    def __post_init__(self) -> None:
        def power_of_two(value: int, low: int, high: int) -> bool:
            return low <= value <= high and value & (value - 1) == 0

        if not (power_of_two(self.block_n, 16, 256) and power_of_two(self.block_k, 16, 512)):
            raise ValueError(
                f"a tile's sides are powers of two, block_n 16..256 and block_k "
                f"16..512, not {self.block_n} x {self.block_k}"
            )
        if not power_of_two(self.warps, 1, 16):
            raise ValueError(f"warps is 1, 2, 4, 8 or 16, not {self.warps}")
        if not 1 <= self.stages <= 8:
            raise ValueError(f"stages is 1..8, not {self.stages}")
        if self.programs_per_sm < 0:
            raise ValueError(f"programs_per_sm is 0 or more, not {self.programs_per_sm}")

    def stages_within(
        self, shared_bytes: int | None, element_size: int, weight_element_size: int | None = None
    ) -> int:
        """The pipeline's depth: ``stages``, or fewer so that a buffer of the row tile and
        the weight tile per stage fits ``shared_bytes`` (None: no limit); the weight's
        elements are ``element_size`` bytes too unless ``weight_element_size`` says. The
        depth only schedules the loads: it never changes a sum."""
        if shared_bytes is None:
            return self.stages
        weight_size = weight_element_size or element_size
        per_stage = (MAX_ROWS * element_size + self.block_n * weight_size) * self.block_k
        return max(1, min(self.stages, shared_bytes // per_stage))


DEFAULT_TILING = Tiling()


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can)."""
    try:
        import triton  # noqa: F401, PLC0415 (a CUDA torch brings it; the CPU may lack it)
    except ImportError:
        return "triton is not installed"
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton compiles for a GPU, not for {device.type} (TRITON_INTERPRET=1 interprets it)"


@functools.cache
def _kernels():
    import triton  # noqa: PLC0415 (imported where the kernel runs, never on the CPU path)
    import triton.language as tl  # noqa: PLC0415

    @triton.jit(do_not_specialize=["rows"])
    def partial_sums(  # noqa: PLR0917
        x,
        w,
        partial,
        scale,
        bias,
        y,
        rows,
        n,
        k,
        k_per_split,
        x_stride,
        w_stride,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        WIDEN: tl.constexpr,
        SCALED: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        DIRECT: tl.constexpr,
    ):
        """partial[split, m, n] = sum over the split's K range of x[m, k] * w[n, k]; DIRECT
        (one split): y[m, n] = that sum (x scale[n] if SCALED, + bias) in y's dtype instead.
        WIDEN: w's tiles (int8) are converted to x's type first."""
        block, split = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
        # tl.full, not tl.zeros: a jitted helper, which the interpreter runs only if it was
        # on when Triton was imported
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        start = split * k_per_split
        for offset in range(0, k_per_split, BLOCK_K):
            rk = start + offset + tl.arange(0, BLOCK_K)
            a = tl.load(
                x + rm[:, None] * x_stride + rk[None, :],
                mask=(rm[:, None] < rows) & (rk[None, :] < k),
                other=0.0,
            )
            b = tl.load(
                w + rn[:, None] * w_stride + rk[None, :],
                mask=(rn[:, None] < n) & (rk[None, :] < k),
                other=0,
            )
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            elif WIDEN:
                b = b.to(a.dtype)
            acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)
        mask = (rm[:, None] < rows) & (rn[None, :] < n)
        if DIRECT:
            if SCALED:
                acc *= tl.load(scale + rn, mask=rn < n, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias + rn, mask=rn < n, other=0.0).to(tl.float32)[None, :]
            tl.store(y + rm[:, None] * n + rn[None, :], acc.to(y.dtype.element_ty), mask=mask)
        else:
            tl.store(partial + split * BLOCK_M * n + rm[:, None] * n + rn[None, :], acc, mask=mask)

    @triton.jit(do_not_specialize=["rows"])
    def add_splits(  # noqa: PLR0917
        partial,
        scale,
        bias,
        y,
        rows,
        n,
        splits,
        SCALED: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """y[m, n] = the splits' partial sums added in split order (x scale[n] if SCALED,
        + bias), in y's dtype."""
        block = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rm[:, None] < rows) & (rn[None, :] < n)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for split in range(0, splits):
            acc += tl.load(
                partial + split * BLOCK_M * n + rm[:, None] * n + rn[None, :], mask=mask, other=0.0
            )
        if SCALED:
            acc *= tl.load(scale + rn, mask=rn < n, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=rn < n, other=0.0).to(tl.float32)[None, :]
        tl.store(y + rm[:, None] * n + rn[None, :], acc.to(y.dtype.element_ty), mask=mask)

    return partial_sums, add_splits


@dataclass(frozen=True)
class SplitPlan:
    """How a weight of ``n`` x ``k`` is cut: ``splits`` K ranges of ``k_per_split``."""

    n_blocks: int
    splits: int
    k_per_split: int

    @classmethod
    def of(cls, n: int, k: int, sm_count: int, tiling: Tiling = DEFAULT_TILING) -> SplitPlan:
        """Enough programs to keep every SM streaming; each split at least two K blocks.
        Depends on the weight's shape and the GPU only, so every row count gets the same."""
        n_blocks = -(-n // tiling.block_n)
        k_blocks = -(-k // tiling.block_k)
        wanted = -(-(tiling.programs_per_sm * sm_count) // n_blocks)
        splits = max(1, min(wanted, k_blocks // 2))
        k_per_split = -(-k_blocks // splits) * tiling.block_k
        return cls(n_blocks, -(-k // k_per_split), k_per_split)


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: an H100's, so the tests cut weights as it does
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def shared_bytes(device: torch.device) -> int | None:
    """The most shared memory one program may take on ``device`` (None: not a GPU)."""
    if device.type != "cuda":
        return None
    # a block may opt in to all of an SM's shared memory but the 1 KiB CUDA keeps for itself
    return torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor - 1024


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the kernel, its grid, its arguments and its compile-time values."""

    kernel: object  # a triton.JITFunction
    grid: tuple[int, ...]
    args: tuple
    constants: dict


def launches(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiling: Tiling = DEFAULT_TILING,
    shared: int | None = None,
    *,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output buffer of ``x @ weight.T * scale + bias`` (``x`` 2-D, at most
    ``MAX_ROWS`` rows, contiguous; ``scale``: None, or float32 (n,) for an int8 ``weight``)
    and the launches that fill it, in order; ``shared``: a program's shared memory in bytes
    (None: what ``x``'s device allows)."""
    rows, k = x.shape
    n = weight.shape[0]
    plan = SplitPlan.of(n, k, sm_count(x.device), tiling)
    partial_sums, add_splits = _kernels()
    direct = plan.splits == 1  # one split: no partial sums to add
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    partial = (
        y
        if direct
        else torch.empty((plan.splits, MAX_ROWS, n), dtype=torch.float32, device=x.device)
    )
    bias_or_any = bias if bias is not None else y  # never read without HAS_BIAS
    scale_or_any = scale if scale is not None else y  # never read without SCALED
    scaled, widen = scale is not None, weight.dtype != x.dtype
    # float32 stays float32 (not TF32): the exact verifier's products are exact. Triton's
    # interpreter multiplies bfloat16 tiles wrongly (3.9), so there they go in as float32.
    # FP fusion on, as Triton has always defaulted (3.9 warns that the default will change):
    # a change would change the bits.
    exact = x.dtype == torch.float32
    upcast = x.device.type == "cpu" and x.dtype == torch.bfloat16
    has_bias = bias is not None
    options = {"num_warps": tiling.warps, "enable_fp_fusion": True}
    stages = tiling.stages_within(
        shared or shared_bytes(x.device), x.element_size(), weight.element_size()
    )
    calls = [
        Launch(
            partial_sums,
            (plan.n_blocks, plan.splits),
            (
                x,
                weight,
                partial,
                scale_or_any,
                bias_or_any,
                y,
                rows,
                n,
                k,
                plan.k_per_split,
                x.stride(0),
                weight.stride(0),
            ),
            {
                "BLOCK_M": MAX_ROWS,
                "BLOCK_N": tiling.block_n,
                "BLOCK_K": tiling.block_k,
                "PRECISION": "ieee" if exact else "tf32",
                "UPCAST": upcast,
                "WIDEN": widen,
                "SCALED": scaled,
                "HAS_BIAS": has_bias,
                "DIRECT": direct,
                "num_stages": stages,
                **options,
            },
        )
    ]
    if not direct:
        calls.append(
            Launch(
                add_splits,
                (plan.n_blocks,),
                (partial, scale_or_any, bias_or_any, y, rows, n, plan.splits),
                {
                    "SCALED": scaled,
                    "HAS_BIAS": has_bias,
                    "BLOCK_M": MAX_ROWS,
                    "BLOCK_N": tiling.block_n,
                    **options,
                },
            )
        )
    return y, calls


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiling: Tiling = DEFAULT_TILING,
    *,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of at most ``MAX_ROWS`` rows (any leading shape
    flattened), accumulated in float32 and returned in ``x``'s dtype. An int8 ``weight``
    comes with ``scale``, float32 (n,): ``x @ (weight * scale[:, None]).T + bias``, the
    scale applied to each finished sum."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    rows, k = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, not {rows}")
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns but the weight {weight.shape[1]}")
    if (weight.dtype == torch.int8) != (scale is not None):
        raise ValueError("an int8 weight comes with a scale per row, any other weight without")
    if weight.dtype not in (x.dtype, torch.int8):
        raise ValueError(f"a {weight.dtype} weight for {x.dtype} rows")
    if scale is not None and (scale.dtype != torch.float32 or scale.shape != weight.shape[:1]):
        raise ValueError(
            f"the scale is float32 of shape ({weight.shape[0]},), not "
            f"{scale.dtype} of {tuple(scale.shape)}"
        )
    x = x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    y, calls = launches(x, weight, bias, tiling, scale=scale)
    for call in calls:
        call.kernel[call.grid](*call.args, **call.constants)
    return y.reshape(*shape[:-1], weight.shape[0])


def kernel_problem(
    weight: torch.Tensor,
    dtype: torch.dtype,
    *,
    scale: torch.Tensor | None = None,
    tiling: Tiling = DEFAULT_TILING,
    seed: int = 0,
) -> str | None:
    """Why the kernel cannot serve ``weight`` (with ``scale`` if int8) for rows of ``dtype``
    here: it failed to build or run, or its sums on random rows are not finite or stray from
    torch's float32 arithmetic further than rounding to ``dtype`` explains. None: it serves."""
    generator = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(MAX_ROWS, weight.shape[1], generator=generator, device=weight.device)
    x = x.to(dtype)
    widened = weight.float() if scale is None else weight.float() * scale[:, None]
    expected = x.float() @ widened.T
    return strayed(
        lambda: skinny_linear(x, weight, None, tiling, scale=scale), expected, "sums", "torch's"
    )


# torch.compile traces ``linear`` into this op: inductor cannot see into a Triton launch made
# from Python, and as an op with a known output shape the kernel stays one call in the
# compiled graph while the small kernels between the matmuls are fused around it.
@torch.library.custom_op("hetspec::skinny_linear", mutates_args=())
def _skinny_linear_op(  # noqa: PLR0917
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    block_n: int,
    block_k: int,
    programs_per_sm: int,
    warps: int,
    stages: int,
) -> torch.Tensor:
    tiling = Tiling(block_n, block_k, programs_per_sm, warps, stages)
    return skinny_linear(x, weight, bias, tiling, scale=scale)


@_skinny_linear_op.register_fake
def _(x, weight, bias, scale, block_n, block_k, programs_per_sm, warps, stages):  # noqa: PLR0917
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` whose calls of at most ``MAX_ROWS`` rows take ``skinny_linear``, cut by
    its ``tiling``."""

    tiling: Tiling = DEFAULT_TILING

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.tiling)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiling: Tiling = DEFAULT_TILING,
    *,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` (an int8 ``weight`` with its ``scale``, as ``skinny_linear`` takes them),
    through ``skinny_linear`` for at most ``MAX_ROWS`` rows; wider calls (a prompt's prefill)
    in torch's matmul, an int8 weight widened to ``x``'s dtype for it."""
    if x.numel() <= MAX_ROWS * x.shape[-1]:
        if torch.compiler.is_compiling():  # one opaque op in the traced graph, fused around
            return torch.ops.hetspec.skinny_linear(x, weight, bias, scale, *astuple(tiling))
        return skinny_linear(x, weight, bias, tiling, scale=scale)
    if scale is None:
        return F.linear(x, weight, bias)
    y = F.linear(x, weight.to(x.dtype)).float() * scale
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def use_skinny_linears(model: nn.Module, tiling: Tiling = DEFAULT_TILING) -> int:
    """Turn every ``nn.Linear`` of ``model`` into a ``SkinnyLinear`` cut by ``tiling``, in
    place (the same parameters and state dict); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SkinnyLinear
            module.tiling = tiling
            count += 1
    return count

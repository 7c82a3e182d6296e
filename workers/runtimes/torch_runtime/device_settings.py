"""What a torch runtime settles at load before its cache and forwards exist: the device, the
dtype, the default context and fixed width, and what computes the linear layers.

Contract: each function returns its choice or raises ``ModelLoadError`` saying why the
request cannot be met here. ``use_matmul`` alone changes anything: the model's linear layers
(and output head), in place, where matmul "triton" or weights "int8" ask for the Triton
kernel (skinny_matmul.py, int8_weights.py) and the kernel serves them.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from hetspec.workers.runtimes.torch_runtime import skinny_matmul
from hetspec.workers.runtimes.torch_runtime.config import ModelLoadError
from hetspec.workers.runtimes.torch_runtime.int8_weights import Int8Linear, use_int8_weights

DEFAULT_MAX_CONTEXT = 8192  # the KV cache for a 128k-context model would not fit most boxes
# A CUDA verifier's rows per forward (``fixed_width``): the widest tree most rounds verify; a
# wider one takes several forwards. On a GPU a forward of 16 rows costs about one of 1.
DEFAULT_FIXED_WIDTH = 16


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {requested!r} requested but CUDA is not available")
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if requested not in dtypes:
        raise ModelLoadError(f"dtype {requested!r} is not one of auto, {', '.join(dtypes)}")
    return dtypes[requested]


def use_matmul(
    model,
    device: torch.device,
    dtype: torch.dtype,
    *,
    matmul: str,
    tiling: dict[str, int] | None,
    weights: str,
) -> tuple[str, str | None]:
    """Put the Triton kernel under ``model``'s linear layers where ``matmul`` or ``weights``
    ask for it; returns the weights' format and why matmul "triton" fell back to torch's
    (None: it did not)."""
    if matmul not in ("torch", "triton"):
        raise ModelLoadError(f'matmul must be "torch" or "triton", not {matmul!r}')
    if weights not in ("dtype", "int8"):
        raise ModelLoadError(f'weights must be "dtype" or "int8", not {weights!r}')
    if matmul == "torch" and weights == "dtype":
        if tiling:
            raise ModelLoadError('matmul_tiling cuts the Triton matmul: it needs matmul "triton"')
        return weights, None
    asked = 'weights "int8" (read by the Triton matmul)' if weights == "int8" else 'matmul "triton"'
    reason = skinny_matmul.unavailable_reason(device)
    if reason is not None:
        raise ModelLoadError(f"{asked} cannot run here: {reason}")
    try:
        cut = replace(skinny_matmul.DEFAULT_TILING, **(tiling or {}))
    except (TypeError, ValueError) as error:
        raise ModelLoadError(f"matmul_tiling: {error}") from None
    if weights == "int8":  # no fallback would be faster: a kernel that cannot serve fails
        use_int8_weights(model, cut)
        head = model.quantized_head
        first = next(m for m in model.modules() if isinstance(m, Int8Linear))
        problem = matmul_problem(dtype, cut, (first.weight, first.scale), (head.weight, head.scale))
        if problem is not None:
            raise ModelLoadError(f"{asked}: the kernel cannot serve them here: {problem}")
        return weights, None
    first = next(m.weight for m in model.modules() if isinstance(m, torch.nn.Linear))
    problem = matmul_problem(dtype, cut, (first, None), (model.head_weight(), None))
    if problem is not None:  # slower, never wrong: cuBLAS, and the device line says why
        return weights, problem
    skinny_matmul.use_skinny_linears(model, cut)
    model.head_linear = partial(skinny_matmul.linear, tiling=cut)
    return weights, None


def matmul_problem(dtype: torch.dtype, tiling: skinny_matmul.Tiling, *weights) -> str | None:
    """Why the Triton kernel cannot serve the (weight, int8 scale or None) pairs given
    (the first layer's and the output head's) in ``dtype``; None: it serves."""
    for weight, scale in weights:
        problem = skinny_matmul.kernel_problem(weight, dtype, scale=scale, tiling=tiling)
        if problem is not None:
            return problem
    return None

"""Linear layers with int8 weights: half the bytes of bfloat16 for a forward to stream.

A verifier's forward of a few rows is bound by how fast its weights stream from memory, so
weights of one byte instead of two nearly halve its matmuls' time: what llama.cpp's Q8_0 gives
llama-server. Each output row of a weight keeps one float32 scale (symmetric, the row's
largest magnitude maps to 127); the activations stay in the model's dtype. The calls of at
most ``skinny_matmul.MAX_ROWS`` rows (every fixed-width forward) run in the Triton kernel,
which widens each int8 tile in registers and scales the finished sums, so a row's bits do not
depend on the rows beside it; wider calls (a prompt's prefill) widen the weight for torch's
matmul, a layer at a time.

Quantizing changes the model: the text is the int8 model's, exactly, in every mode (its
target alone runs through the same kernels), not the bfloat16 model's.
"""

from __future__ import annotations

import torch
from torch import nn

from hetspec.workers.runtimes.torch_runtime import skinny_matmul
from hetspec.workers.runtimes.torch_runtime.model import CausalLM
from hetspec.workers.runtimes.torch_runtime.skinny_matmul import DEFAULT_TILING, Tiling

LEVELS = 127  # symmetric: -127..127, so a row's scale maps its largest magnitude exactly


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (n, k) as int8 (n, k) and float32 scales (n,) with weight ~ q * scale[:, None];
    an all-zero row gets scale 1 (and zeros)."""
    rows = weight.float()
    largest = rows.abs().amax(dim=1)
    scale = torch.where(largest > 0, largest / LEVELS, torch.ones_like(largest))
    quantized = torch.round(rows / scale[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return quantized, scale


class Int8Linear(nn.Module):
    """A linear layer of int8 weights (``weight``) with a float32 scale per output row
    (``scale``) and the original's bias in the activations' dtype."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        tiling: Tiling = DEFAULT_TILING,
    ) -> None:
        """``weight`` (n, k) in full precision, quantized here."""
        super().__init__()
        quantized, scale = quantize_rows(weight)
        self.register_buffer("weight", quantized)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.tiling = tiling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_matmul.linear(x, self.weight, self.bias, self.tiling, scale=self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, int8"


def use_int8_weights(model: CausalLM, tiling: Tiling = DEFAULT_TILING) -> None:
    """Replace every linear layer of ``model`` by an ``Int8Linear`` cut by ``tiling``, in
    place, each original freed as it goes, and give the output head an int8 copy (a tied
    head's embedding stays for its lookups)."""
    # names only, so that each original is freed when it is replaced
    layers = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name in layers:
        layer = getattr(parent, name)
        setattr(parent, name, Int8Linear(layer.weight, layer.bias, tiling))
        del layer
    if model.config.tie_word_embeddings:
        model.quantized_head = Int8Linear(model.head_weight(), None, tiling)
    else:
        model.quantized_head = model.lm_head

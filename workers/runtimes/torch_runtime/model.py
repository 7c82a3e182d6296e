"""A Llama-family decoder (Gemma 2 and 3 too) for inference over an external, preallocated KV cache.

Parameter names match the Hugging Face checkpoints (``model.layers.0.self_attn.q_proj.weight``),
so a safetensors file loads into it with no renaming. The model is stateless: the caller passes
the cache, where to write the new keys/values, and which cached keys each new token may see.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hetspec.workers.runtimes.torch_runtime import split_kernel
from hetspec.workers.runtimes.torch_runtime.config import ModelConfig, RopeScaling
from hetspec.workers.runtimes.torch_runtime.split_attention import SplitRows, split_attention


class RMSNorm(nn.Module):
    """``gemma``: the weight is stored as (scale - 1) and applied before the cast back from
    float32, as Gemma's reference does (Llama's casts first)."""

    def __init__(self, size: int, eps: float, *, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference does; fp16 squares overflow on real activations.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def norm(config: ModelConfig, size: int | None = None) -> RMSNorm:
    """An RMSNorm of ``size`` (default: the hidden size) in the model's convention."""
    return RMSNorm(size or config.hidden_size, config.rms_norm_eps, gemma=config.gemma_norms)


def rope_inverse_frequencies(rope: RopeScaling, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept, and the band
        # between them interpolated smoothly.
        wavelength = 2 * math.pi / inv_freq
        low_wavelength = rope.original_context / rope.low_freq_factor
        high_wavelength = rope.original_context / rope.high_freq_factor
        scaled = torch.where(wavelength > low_wavelength, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_context / wavelength - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        middle = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
        return torch.where(middle, smoothed, scaled)
    return inv_freq


def rope_tables(
    config: ModelConfig, length: int, device: torch.device, rope: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..length-1, shape (length, head_dim), in fp32, for
    ``rope`` (default: the model's)."""
    inv_freq = rope_inverse_frequencies(rope or config.rope, config.head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device), angles.sin().to(device)


def layer_rope_tables(
    config: ModelConfig, length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each of ``config.rope_kinds``: (kinds, length, head_dim), what
    ``CausalLM.forward`` takes (indexed by position on dimension 1)."""
    tables = [rope_tables(config, length, device, rope) for rope in config.rope_kinds]
    return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head (the Hugging Face layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None = None) -> None:
        """``window``: the layer's sliding window (split attention's kernel applies it)."""
        super().__init__()
        self.window = window
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = norm(config, head_dim)
            self.k_norm = norm(config, head_dim)
        self.qk_norm = config.qk_norm
        self.scale = config.query_scale
        self.softcap = config.attn_softcap

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        mask: torch.Tensor | None,
        slots: torch.Tensor | None = None,
        paths: tuple[torch.Tensor, torch.Tensor] | None = None,
        split: SplitRows | None = None,
    ) -> torch.Tensor:
        """x: (n, hidden) new tokens; keys/values: (kv_heads, capacity, head_dim) cache views.

        The new keys/values go to cache slots start..start+n-1; the tokens attend to slots
        0..start+n-1 as ``mask`` (n, start+n) allows (None: all of them). With ``slots`` (n,)
        they go to those slots instead and the tokens attend to slots 0..mask.shape[1]-1:
        shapes that do not depend on where the tokens sit, so a CUDA graph can replay them.

        ``paths`` = (gather (p, span), row_paths (n,)): each token attends instead to the
        keys its path's gather row lists, in position order (``mask``: (p, n, span), by
        position); so a token sees the same keys in the same places whether its tree's
        siblings sit between its ancestors in the cache or not.

        ``split``: attention split as split_attention.py does, over the first slots in place
        and over each row's tail's; ``mask`` then an additive float32 (n, span + tail)
        (``split_bias``; None for the kernel; with ``slots``).
        """
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(0, 1), cos, sin)
        if slots is None:
            keys[:, start : start + n] = apply_rope(k.transpose(0, 1), cos, sin)
            values[:, start : start + n] = v.transpose(0, 1)
            span = start + n
        else:
            keys.index_copy_(1, slots, apply_rope(k.transpose(0, 1), cos, sin))
            values.index_copy_(1, slots, v.transpose(0, 1))
            span = None if mask is None else mask.shape[-1]
        if split is not None:
            return self.o_proj(self._split(q, keys, values, split, mask))
        if paths is not None:
            gather, row_paths = paths
            count = gather.shape[0]
            out = self._attend(
                q.unsqueeze(0).expand(count, -1, -1, -1),
                keys[:, gather].transpose(0, 1),
                values[:, gather].transpose(0, 1),
                mask.unsqueeze(1),
            )  # (paths, heads, n, head_dim): each token's row from its own path
            out = out[row_paths, :, torch.arange(n, device=x.device)]
            return self.o_proj(out.reshape(n, self.heads * self.head_dim))
        out = self._attend(
            q.unsqueeze(0), keys[:, :span].unsqueeze(0), values[:, :span].unsqueeze(0), mask
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(n, self.heads * self.head_dim))

    def _split(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        split: SplitRows,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Split attention of q (heads, n, d): (n, heads * d)."""
        n, scale = q.shape[1], self.scale or self.head_dim**-0.5
        if split.kernel:
            out = split_kernel.attend(
                q,
                keys,
                values,
                split.tail_slots,
                split.positions,
                block=split.block,
                scale=scale,
                softcap=self.softcap,
                window=self.window,
            )
            return out.view(n, self.heads * self.head_dim)
        out = split_attention(
            q, keys, values, split.tail_slots, bias, scale=scale, softcap=self.softcap
        )
        return out.transpose(0, 1).reshape(n, self.heads * self.head_dim)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of q (b, heads, n, d) over k, v (b, kv_heads, keys, d) where the boolean
        ``mask`` allows (None: everywhere)."""
        grouped = self.heads != self.kv_heads
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=grouped
            )
        # Soft-capped scores (Gemma 2) are not something fused attention kernels compute.
        if grouped:
            repeat = self.heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * (self.scale or self.head_dim**-0.5)
        scores = self.softcap * torch.tanh(scores / self.softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate = gelu_tanh if config.activation == "gelu_tanh" else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate(self.gate_proj(x)) * self.up_proj(x))


# A layer's parameters by half (attention, MLP), as checkpoints name them: in a Gemma layer
# post_attention_layernorm normalises the attention's output, in a Llama one the MLP's input.
LLAMA_MLP_PARTS = frozenset({"post_attention_layernorm", "mlp"})
SANDWICH_MLP_PARTS = frozenset({"pre_feedforward_layernorm", "post_feedforward_layernorm", "mlp"})


def mlp_parts(config: ModelConfig) -> frozenset[str]:
    """The names (``model.layers.N.<name>...``) of a layer's MLP half's parameters."""
    return SANDWICH_MLP_PARTS if config.sandwich_norms else LLAMA_MLP_PARTS


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = norm(config)
        self.self_attn = Attention(config, config.sliding_windows[index])
        self.post_attention_layernorm = norm(config)
        self.mlp = MLP(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(config)
            self.post_feedforward_layernorm = norm(config)
        self.rope_kind = config.layer_ropes[index]

    def attention_half(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **attend
    ) -> torch.Tensor:
        """x plus this layer's attention (``Attention.forward``'s keywords); cos/sin
        (kinds, n, head_dim) as ``layer_rope_tables`` indexed by position."""
        out = self.self_attn(
            self.input_layernorm(x), cos[self.rope_kind], sin[self.rope_kind], **attend
        )
        return x + (self.post_attention_layernorm(out) if self.sandwich else out)

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        if self.sandwich:
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self.mlp(self.post_attention_layernorm(x))


def unfilled_embedding(vocab: int, width: int) -> nn.Embedding:
    """An embedding whose weight a checkpoint fills: not initialised first. (On the meta
    device nn.Embedding's random init imports torch._dynamo, seconds of every model load:
    docs/design-notes.md, "Loading a torch model".)"""
    return nn.Embedding(vocab, width, _weight=torch.empty(vocab, width))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = unfilled_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = norm(config)
        self.embed_scale = config.embed_scale

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if self.embed_scale is None:
            return x
        # the scale rounded to the weights' type first, as Gemma's reference does
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)


class CausalLM(nn.Module):
    """The decoder stack plus the output head; tied models reuse the embedding as the head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.head_linear = F.linear  # the output head's matmul (skinny_matmul may take it)
        # an int8 copy of the head that replaces it (int8_weights.use_int8_weights)
        self.quantized_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cache_keys: torch.Tensor,
        cache_values: torch.Tensor,
        start: int,
        masks: list[torch.Tensor | None],
        slots: torch.Tensor | None = None,
        paths: tuple[torch.Tensor, torch.Tensor] | None = None,
        split: SplitRows | None = None,
    ) -> torch.Tensor:
        """Run ``tokens`` (n,) through every layer; returns the last layer's output (n, hidden).

        ``cos``/``sin``: (kinds, n, head_dim), ``layer_rope_tables`` at the tokens' positions;
        ``cache_keys``/``cache_values``: (layers, kv_heads, capacity, head_dim); ``masks``: one
        attention mask per layer (layers with the same window share one tensor); ``slots``,
        ``paths``, ``split``: see ``Attention.forward``.
        """
        x = self.model.embed(tokens)
        return self.run_halves(
            x,
            range(2 * len(self.model.layers)),
            cos,
            sin,
            cache_keys=cache_keys,
            cache_values=cache_values,
            start=start,
            masks=masks,
            slots=slots,
            paths=paths,
            split=split,
        )

    def run_halves(
        self,
        x: torch.Tensor,
        halves: range,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cache_keys: torch.Tensor,
        cache_values: torch.Tensor,
        start: int,
        masks: list[torch.Tensor | None],
        slots: torch.Tensor | None = None,
        paths: tuple[torch.Tensor, torch.Tensor] | None = None,
        split: SplitRows | None = None,
    ) -> torch.Tensor:
        """Run hidden states (n, hidden) through half-layers ``halves`` (a pipeline stage's
        share; half 2i is layer i's attention with its input norm, 2i + 1 its MLP with its
        norm); ``cache_keys``/``masks`` are indexed by the range's attention halves in order."""
        attention = 0
        for half in halves:
            layer = self.model.layers[half // 2]
            if half % 2 == 0:
                x = layer.attention_half(
                    x,
                    cos,
                    sin,
                    keys=cache_keys[attention],
                    values=cache_values[attention],
                    start=start,
                    mask=masks[attention],
                    slots=slots,
                    paths=paths,
                    split=split,
                )
                attention += 1
            else:
                x = layer.mlp_half(x)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for final hidden states (n, hidden) -> (n, vocab)."""
        normed = self.model.norm(hidden)
        if self.quantized_head is not None:
            logits = self.quantized_head(normed).float()
        else:
            logits = self.head_linear(normed, self.head_weight()).float()
        cap = self.config.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

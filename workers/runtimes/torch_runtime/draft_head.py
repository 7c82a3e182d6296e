"""Dovetail's draft head: a small decoder that drafts from the target's own features.

A feature is the target's hidden state as it enters its LM head (after the final norm). At
position t the head reads the feature of position t - 1 and the embedding of token t, fuses
them (Dynamic Gating Fusion: a = W_h h, b = W_e e, z = sigmoid(W_g [a; b]),
fused = z * a + (1 - z) * b; or EAGLE's plain fusion, one linear map of [e; h]), runs
``blocks`` Llama decoder blocks, and writes a predicted feature of position t through the
target's own final norm; the target's LM head turns it into the next token's logits. Drafting
feeds each predicted feature back in as the next position's, as EAGLE does.

The head's folder holds ``head_config.json`` and ``model.safetensors`` with the head's own
weights only: the embedding, final norm and LM head are read from the target's folder, frozen.
A head narrower than its target's features (``width < feature_size``) writes only the first
``width`` dimensions of the feature, the rest zero: how one head serves the heavy targets,
whose features are the demo target's, zero-padded.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from hetspec.workers.runtimes.torch_runtime.config import (
    ModelConfig,
    ModelLoadError,
    RopeScaling,
    read_folder_json,
)
from hetspec.workers.runtimes.torch_runtime.model import (
    DecoderLayer,
    RMSNorm,
    apply_rope,
    unfilled_embedding,
)
from hetspec.workers.runtimes.torch_runtime.weights import checkpoint_files

HEAD_CONFIG = "head_config.json"
FORMAT_VERSION = 1
Fusion = Literal["dgf", "concat"]


@dataclass(frozen=True)
class HeadConfig:
    feature_size: int  # the target's hidden size: features in, feature out, embeddings
    width: int  # the head's blocks' hidden size (<= feature_size)
    vocab_size: int
    blocks: int
    fusion: Fusion
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_context: int
    vocab_fingerprint: str  # the target vocabulary's (protocol.VocabInfo.fingerprint)

    def __post_init__(self) -> None:
        if self.fusion not in ("dgf", "concat"):
            raise ModelLoadError(f"fusion must be 'dgf' or 'concat', not {self.fusion!r}")
        if not 0 <= self.blocks <= 8:
            raise ModelLoadError(f"blocks must be 0..8, not {self.blocks}")
        if not 0 < self.width <= self.feature_size:
            raise ModelLoadError(
                f"width {self.width} must be 1..feature_size ({self.feature_size})"
            )

    @classmethod
    def from_folder(cls, folder: Path) -> HeadConfig:
        path = Path(folder) / HEAD_CONFIG
        raw = read_folder_json(folder, HEAD_CONFIG, "a draft head")
        if raw.pop("format", None) != FORMAT_VERSION:
            raise ModelLoadError(f"{path}: not a format-{FORMAT_VERSION} draft head config")
        try:
            return cls(**raw)
        except TypeError as error:
            raise ModelLoadError(f"{path}: {error}") from None

    def save(self, folder: Path) -> None:
        text = json.dumps({"format": FORMAT_VERSION, **asdict(self)}, indent=2) + "\n"
        (Path(folder) / HEAD_CONFIG).write_text(text)

    def block_config(self) -> ModelConfig:
        """The blocks' shape, as the target runtime's layers take it."""
        return ModelConfig(
            model_type="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.width,
            intermediate_size=self.intermediate_size,
            num_layers=self.blocks,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_context=self.max_context,
            rope=RopeScaling(self.rope_theta),
            tie_word_embeddings=False,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            sliding_windows=(None,) * self.blocks,
        )


class DraftHead(nn.Module):
    """The head's own weights: fusion and blocks. ``forward`` returns the blocks' output
    (n, width), before the target's final norm."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        d, w = config.feature_size, config.width
        if config.fusion == "dgf":
            self.feature_proj = nn.Linear(d, w, bias=False)  # W_h
            self.token_proj = nn.Linear(d, w, bias=False)  # W_e
            self.gate = nn.Linear(2 * w, w)  # W_g
        else:
            self.fuse = nn.Linear(2 * d, w)
        self.layers = nn.ModuleList(
            DecoderLayer(config.block_config()) for _ in range(config.blocks)
        )

    def fused(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        if self.config.fusion == "concat":
            return self.fuse(torch.cat([embeddings, features], dim=-1))
        a, b = self.feature_proj(features), self.token_proj(embeddings)
        z = torch.sigmoid(self.gate(torch.cat([a, b], dim=-1)))
        return z * a + (1 - z) * b

    def forward(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cache_keys: torch.Tensor,
        cache_values: torch.Tensor,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """New nodes (n, feature_size) each, keys/values to cache slots start..start+n-1
        (``cache_keys``: (blocks, kv_heads, capacity, head_dim)), attending as ``mask``."""
        x = self.fused(features, embeddings)
        for index, layer in enumerate(self.layers):
            x = x + layer.self_attn(
                layer.input_layernorm(x),
                cos,
                sin,
                keys=cache_keys[index],
                values=cache_values[index],
                start=start,
                mask=mask,
            )
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def sequences(
        self, features: torch.Tensor, embeddings: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Training's forward: whole sequences (batch, length, feature_size), causal, no cache;
        ``cos``/``sin`` (length, head_dim)."""
        x = self.fused(features, embeddings)
        batch, length, _ = x.shape
        for layer in self.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(batch, length, attn.heads, attn.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(batch, length, attn.kv_heads, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(batch, length, attn.kv_heads, attn.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            grouped = attn.heads != attn.kv_heads
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x


class TargetPieces(nn.Module):
    """What the head borrows from its target, frozen: embedding, final norm, LM head."""

    def __init__(self, vocab_size: int, feature_size: int, eps: float) -> None:
        super().__init__()
        self.embed = unfilled_embedding(vocab_size, feature_size)
        self.norm = RMSNorm(feature_size, eps)
        self.lm_head = nn.Linear(feature_size, vocab_size, bias=False)

    def feature(self, output: torch.Tensor) -> torch.Tensor:
        """A head output (n, width), zero-padded to the feature size, through the final norm."""
        pad = self.embed.embedding_dim - output.shape[-1]
        return self.norm(F.pad(output, (0, pad)) if pad else output)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head(features).float()


def load_target_pieces(
    target: ModelConfig, folder: Path, dtype: torch.dtype, device: torch.device
) -> TargetPieces:
    """Read only the three tensors the head borrows from the target folder's safetensors."""
    if target.gemma_norms or target.embed_scale is not None or target.final_softcap is not None:
        # the pieces are Llama's: a Gemma target's norm, embedding scale and logit cap differ
        raise ModelLoadError(
            f"{folder}: draft heads are built for Llama-family targets, not {target.model_type}"
        )
    names = {
        "model.embed_tokens.weight": "embed.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if target.tie_word_embeddings:
        names.pop("lm_head.weight")
    state = {}
    for path in checkpoint_files(folder):
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as handle:
                for name in set(handle.keys()) & names.keys():
                    state[names[name]] = handle.get_tensor(name).to(dtype)
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{path}: not a readable safetensors file: {error}") from None
    if target.tie_word_embeddings and "embed.weight" in state:
        state["lm_head.weight"] = state["embed.weight"]
    missing = sorted(set(names.values()) - set(state))
    if missing:
        raise ModelLoadError(f"{folder}: the target lacks {', '.join(missing)}")
    with torch.device("meta"):
        pieces = TargetPieces(target.vocab_size, target.hidden_size, target.rms_norm_eps)
    pieces.load_state_dict(state, strict=True, assign=True)
    return pieces.eval().requires_grad_(False)


def load_head(
    folder: Path, target: ModelConfig, dtype: torch.dtype, device: torch.device
) -> DraftHead:
    """The head in ``folder``, checked against the target it will draft for."""
    config = HeadConfig.from_folder(folder)
    if config.feature_size != target.hidden_size or config.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"{folder}: the head reads {config.feature_size}-wide features over a "
            f"{config.vocab_size}-token vocabulary; the target has {target.hidden_size} and "
            f"{target.vocab_size}: it was trained for another target"
        )
    with torch.device("meta"):
        head = DraftHead(config)
    expected = {name: tuple(p.shape) for name, p in head.named_parameters()}
    state = {}
    for path in checkpoint_files(folder):
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as handle:
                for name in handle.keys():  # noqa: SIM118
                    tensor = handle.get_tensor(name)
                    if expected.get(name) != tuple(tensor.shape):
                        raise ModelLoadError(
                            f"{folder}: tensor {name} {tuple(tensor.shape)} is "
                            f"not the head's ({expected.get(name)})"
                        )
                    state[name] = tensor.to(dtype)
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{path}: not a readable safetensors file: {error}") from None
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{folder}: missing tensors: {', '.join(missing[:5])}")
    head.load_state_dict(state, strict=True, assign=True)
    return head.eval().requires_grad_(False)

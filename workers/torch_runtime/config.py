"""What the runtime needs from a Hugging Face ``config.json``, checked up front."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# model_type -> (q/k/v bias forced on, per-head q/k RMSNorm)
ARCHITECTURES = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; the message names the folder and the problem."""


def read_folder_json(folder: Path, name: str, kind: str) -> dict:
    """``folder``/``name`` parsed; a missing or unreadable file is a ``ModelLoadError``."""
    path = Path(folder) / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{folder}: no {name}; is this {kind}?") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{path}: unreadable: {error}") from None


@dataclass(frozen=True)
class RopeScaling:
    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_context: int
    rope: RopeScaling
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # One entry per layer: the attention window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...]

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        raw = read_folder_json(folder, "config.json", "a model folder")
        try:
            return cls.from_dict(raw)
        except ModelLoadError as error:
            raise ModelLoadError(f"{folder}: {error}") from None

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            layers = int(raw["num_hidden_layers"])
            forced_bias, qk_norm = ARCHITECTURES[model_type]
            attention_bias = bool(raw.get("attention_bias", False))
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_context=int(raw.get("max_position_embeddings", 2048)),
                rope=_rope(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=forced_bias or attention_bias,
                o_bias=attention_bias and not forced_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=qk_norm,
                sliding_windows=_sliding_windows(raw, model_type, layers),
            )
        except KeyError as error:
            raise ModelLoadError(f"config.json lacks {error.args[0]!r}") from None
        except (TypeError, ValueError) as error:
            raise ModelLoadError(f"config.json has a malformed value: {error}") from None


def _rope(raw: dict) -> RopeScaling:
    # transformers >= 5 writes `rope_parameters`; older files have rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    merged = {**legacy, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"RoPE type {kind!r} is not supported; supported: {ROPE_TYPES}")
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if not math.isfinite(theta) or theta <= 0:
        raise ModelLoadError(f"rope_theta must be positive, not {theta}")
    if kind == "default":
        return RopeScaling(theta)
    if kind == "linear":
        return RopeScaling(theta, kind, factor=float(merged["factor"]))
    return RopeScaling(
        theta,
        kind,
        factor=float(merged["factor"]),
        low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_context=int(merged["original_max_position_embeddings"]),
    )


def _sliding_windows(raw: dict, model_type: str, layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if model_type in {"qwen2", "qwen3"} and not raw.get("use_sliding_window", False):
        window = None
    if not window:
        return (None,) * layers
    kinds = raw.get("layer_types")
    if kinds is None:
        if model_type == "mistral":
            kinds = ["sliding_attention"] * layers
        else:  # Qwen: the layers from max_window_layers on use the window.
            first = int(raw.get("max_window_layers", layers))
            kinds = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    if len(kinds) != layers:
        raise ModelLoadError(f"layer_types has {len(kinds)} entries for {layers} layers")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)

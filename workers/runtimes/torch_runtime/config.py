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
    "gemma2": (False, False),
    "gemma3_text": (False, True),
}
# Gemma's differences from a Llama layer: see ModelConfig's fields from `activation` on.
GEMMA_TYPES = frozenset({"gemma2", "gemma3_text"})
# Layer i uses a sliding window unless (i + 1) is a multiple of this, in configs that predate
# `layer_types` (transformers' own defaults).
GEMMA_WINDOW_PERIOD = {"gemma2": 2, "gemma3_text": 6}
GEMMA_DEFAULT_WINDOW = 4096
GEMMA3_LOCAL_THETA = 10000.0  # Gemma 3's sliding layers' rotary base unless the file says
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
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
    # The rotary scaling of the windowed layers where it differs from ``rope`` (Gemma 3's).
    window_rope: RopeScaling | None = None
    activation: str = "silu"  # the MLP's gate: "silu" or "gelu_tanh"
    # Gemma: RMSNorm weights stored as (scale - 1) and applied in float32; norms of the
    # attention's and the MLP's outputs too ("sandwich"); embeddings times sqrt(hidden_size).
    gemma_norms: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)

    @property
    def layer_ropes(self) -> tuple[int, ...]:
        """Per layer, which of ``rope_kinds`` rotates its queries and keys."""
        if self.window_rope is None:
            return (0,) * self.num_layers
        return tuple(int(window is not None) for window in self.sliding_windows)

    @property
    def rope_kinds(self) -> tuple[RopeScaling, ...]:
        return (self.rope,) if self.window_rope is None else (self.rope, self.window_rope)

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
        gemma = model_type in GEMMA_TYPES
        act_key = "hidden_activation" if gemma and "hidden_activation" in raw else "hidden_act"
        act = raw.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
        if act not in ACTIVATIONS:
            raise ModelLoadError(
                f"{act_key} {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        if raw.get("use_bidirectional_attention"):
            raise ModelLoadError("bidirectional attention (an embedding model) is not a decoder")
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            layers = int(raw["num_hidden_layers"])
            forced_bias, qk_norm = ARCHITECTURES[model_type]
            attention_bias = bool(raw.get("attention_bias", False))
            head_dim = int(raw.get("head_dim") or hidden // heads)
            rope, window_rope = (
                _gemma3_ropes(raw) if model_type == "gemma3_text" else (_rope(raw), None)
            )
            gemma_fields = {}
            if gemma:
                gemma_fields = {
                    "gemma_norms": True,
                    "sandwich_norms": True,
                    "embed_scale": hidden**0.5,
                    "query_scale": float(raw.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                    "attn_softcap": _positive_or_none(raw, "attn_logit_softcapping"),
                    "final_softcap": _positive_or_none(raw, "final_logit_softcapping"),
                }
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_context=int(raw.get("max_position_embeddings", 2048)),
                rope=rope,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
                qkv_bias=forced_bias or attention_bias,
                o_bias=attention_bias and not forced_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=qk_norm,
                sliding_windows=_sliding_windows(raw, model_type, layers),
                window_rope=window_rope,
                activation=ACTIVATIONS[act],
                **gemma_fields,
            )
        except KeyError as error:
            raise ModelLoadError(f"config.json lacks {error.args[0]!r}") from None
        except (TypeError, ValueError) as error:
            raise ModelLoadError(f"config.json has a malformed value: {error}") from None


def _positive_or_none(raw: dict, key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if not float(value) > 0:
        raise ModelLoadError(f"{key} must be positive or null, not {value}")
    return float(value)


def _rope(raw: dict, params: dict | None = None, default_theta: float = 10000.0) -> RopeScaling:
    # transformers >= 5 writes `rope_parameters`; older files have rope_theta + rope_scaling.
    if params is None:
        params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    merged = {**legacy, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"RoPE type {kind!r} is not supported; supported: {ROPE_TYPES}")
    theta = float(merged.get("rope_theta", raw.get("rope_theta", default_theta)))
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


def _gemma3_ropes(raw: dict) -> tuple[RopeScaling, RopeScaling]:
    """(full layers' rope, windowed layers' rope): transformers >= 5 keys ``rope_parameters``
    by layer type; older files have rope_theta + rope_scaling for the full layers and
    rope_local_base_freq (unscaled) for the windowed ones."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = _rope(raw, dict(params.get("full_attention") or {}), 1_000_000.0)
        local_params = dict(params.get("sliding_attention") or {})
        local = _rope({}, local_params, raw.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))
        return full, local
    local_theta = float(raw.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))
    return _rope(raw, dict(params), 1_000_000.0), RopeScaling(local_theta)


def _sliding_windows(raw: dict, model_type: str, layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if model_type in {"qwen2", "qwen3"} and not raw.get("use_sliding_window", False):
        window = None
    if model_type in GEMMA_TYPES and window is None:
        window = GEMMA_DEFAULT_WINDOW
    if not window:
        return (None,) * layers
    kinds = raw.get("layer_types")
    if kinds is None and model_type in GEMMA_TYPES:
        period = int(raw.get("sliding_window_pattern") or GEMMA_WINDOW_PERIOD[model_type])
        kinds = [
            "full_attention" if (i + 1) % period == 0 else "sliding_attention"
            for i in range(layers)
        ]
    if kinds is None:
        if model_type == "mistral":
            kinds = ["sliding_attention"] * layers
        else:  # Qwen: the layers from max_window_layers on use the window.
            first = int(raw.get("max_window_layers", layers))
            kinds = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    if len(kinds) != layers:
        raise ModelLoadError(f"layer_types has {len(kinds)} entries for {layers} layers")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)

"""The padding recipe: a trained Llama widened, deepened and given more heads and neurons that
cost what a bigger model costs, while its logits stay the trained model's.

How the padding keeps the logits (d, h, i: the trained width, heads, FFN size; D, H, I: the
padded ones). Trained weights sit in the first d residual dims, the first h query heads and
first kv heads, the first i FFN neurons and the first layers; every added part writes exactly
zero to the residual stream, so the residual stays zero beyond dim d:

- embedding columns d..D are zero; rows d..D of o_proj and down_proj are zero;
- o_proj columns of added heads and down_proj columns of added neurons are zero;
- added layers have all-zero o_proj and down_proj (their norms have weight 1; their outputs
  are discarded anyway);
- RMSNorm over D dims of a vector that is zero beyond d gives rms_D = rms_d * sqrt(d/D), so
  norm weights become w * sqrt(d/D) and eps becomes eps * d/D. D/d is a power of four, so the
  factor is a power of two and exact in f16;
- query/key heads keep head_dim and the GQA group size, so trained query head j still reads kv
  head j // group;
- everything else added (q/k/v of added heads, gate/up of added neurons, the added layers'
  q/k/v/gate/up, an untied lm_head's and q/k/v/gate/up's columns for dims d..D, which
  multiply zeros) is seeded random (std 0.02), so the model costs what a real one of its size
  costs. A tied model stays tied: its output head is the embedding, whose added columns are
  zero, and reads as many bytes as an untied one's would.

Every trained block starts at a multiple of 32 and is a whole number of 32-blocks long, so Q8_0
and Q4_0 quantize the trained weights exactly as they do in the trained model's own export.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

SEED = 0
INIT_STD = 0.02


class PaddingError(ValueError):
    """A shape cannot hold the trained model exactly; the message says why."""


@dataclass(frozen=True)
class HeavyShape:
    """The padded architecture; head_dim, vocabulary and the rest stay the trained model's."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def params(self, vocab_size: int, head_dim: int, *, tied: bool = False) -> int:
        """Exact parameter count (the output head counted once more when untied)."""
        d, q, kv = self.hidden_size, self.num_heads * head_dim, self.num_kv_heads * head_dim
        layer = 2 * d * q + 2 * d * kv + 3 * d * self.intermediate_size + 2 * d
        return self.num_layers * layer + (1 if tied else 2) * vocab_size * d + d


def heavy_config(source: Mapping, shape: HeavyShape, name: str, dtype: type = np.float16) -> dict:
    """The padded model's config.json: ``source``'s with the padded shape and rescaled eps.

    Raises PaddingError when ``shape`` cannot hold ``source`` exactly.
    """
    d, heads, kv_heads = (
        source["hidden_size"],
        source["num_attention_heads"],
        source.get("num_key_value_heads", source["num_attention_heads"]),
    )
    ratio = shape.hidden_size / d
    problems = [
        f"{key} {theirs} < the target's {ours}"
        for key, theirs, ours in (
            ("hidden_size", shape.hidden_size, d),
            ("num_layers", shape.num_layers, source["num_hidden_layers"]),
            ("num_heads", shape.num_heads, heads),
            ("num_kv_heads", shape.num_kv_heads, kv_heads),
            ("intermediate_size", shape.intermediate_size, source["intermediate_size"]),
        )
        if theirs < ours
    ]
    if not (ratio.is_integer() and math.log(ratio, 4).is_integer()):
        problems.append(f"hidden_size {shape.hidden_size} is not {d} times a power of four")
    if shape.num_heads * kv_heads != heads * shape.num_kv_heads:
        problems.append("the query heads per kv head differ from the target's")
    if problems:
        raise PaddingError(f"{name}: {'; '.join(problems)}")
    return {
        **source,
        "_name_or_path": f"hetspec-{name}",
        "dtype": np.dtype(dtype).name,
        "torch_dtype": np.dtype(dtype).name,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.intermediate_size,
        "head_dim": source.get("head_dim") or d // heads,
        "rms_norm_eps": source["rms_norm_eps"] * d / shape.hidden_size,
    }


def seeded_noise(name: str, shape: tuple[int, ...], dtype: type = np.float16) -> np.ndarray:
    """Seeded N(0, INIT_STD) noise; the seed depends on the tensor name, not on order."""
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    noise = rng.standard_normal(shape, dtype=np.float32)
    noise *= INIT_STD
    return noise.astype(dtype)


def heavy_tensors(
    source: Mapping[str, np.ndarray], source_config: Mapping, config: Mapping, dtype: type
) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the padded model in ``dtype``, trained blocks first in each dimension.

    ``config`` comes from ``heavy_config(source_config, ...)``.
    """
    d, big = source_config["hidden_size"], config["hidden_size"]
    scale = np.float32(math.sqrt(d / big))  # a power of two: exact in any float
    head_dim, layers = config["head_dim"], source_config["num_hidden_layers"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    inner = config["intermediate_size"]

    def around(name: str, shape: tuple[int, int], fill: str) -> np.ndarray:
        out = seeded_noise(name, shape, dtype) if fill == "noise" else np.zeros(shape, dtype)
        trained = source[name]
        out[: trained.shape[0], : trained.shape[1]] = trained
        return out

    def norm(name: str) -> np.ndarray:
        out = np.full(big, scale, dtype)  # dims past d hold zeros: any weight will do
        out[:d] = source[name].astype(np.float32) * scale
        if not np.array_equal(out[:d].astype(np.float32) / scale, source[name]):
            raise PaddingError(f"{name}: scaling by {scale} is not exact in {np.dtype(dtype)}")
        return out

    vocab = source_config["vocab_size"]
    yield "model.embed_tokens.weight", around("model.embed_tokens.weight", (vocab, big), "zeros")
    if "lm_head.weight" in source:
        yield "lm_head.weight", around("lm_head.weight", (vocab, big), "noise")
    yield "model.norm.weight", norm("model.norm.weight")
    for index in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{index}."
        shapes = {
            "self_attn.q_proj": (q_rows, big),
            "self_attn.k_proj": (kv_rows, big),
            "self_attn.v_proj": (kv_rows, big),
            "self_attn.o_proj": (big, q_rows),
            "mlp.gate_proj": (inner, big),
            "mlp.up_proj": (inner, big),
            "mlp.down_proj": (big, inner),
        }
        for part, shape in shapes.items():
            name = f"{prefix}{part}.weight"
            writes_residual = part in ("self_attn.o_proj", "mlp.down_proj")
            if index < layers:
                yield name, around(name, shape, "zeros" if writes_residual else "noise")
            elif writes_residual:  # an added layer: computes, and adds nothing
                yield name, np.zeros(shape, dtype)
            else:
                yield name, seeded_noise(name, shape, dtype)
        for part in ("input_layernorm", "post_attention_layernorm"):
            name = f"{prefix}{part}.weight"
            yield name, norm(name) if index < layers else np.ones(big, dtype)

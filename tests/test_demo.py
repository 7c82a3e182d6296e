"""`make demo`, the README's first command: the real model (else the bundled pair) answers,
and the demo leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_answers_and_removes_its_temporary_folder(tmp_path: Path) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    environment = {**os.environ, "TMPDIR": str(temporary), "DEMO_PROMPT": "def add(a, b):"}
    done = subprocess.run(
        ["make", "-s", "demo"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    if "Question:" in done.stdout:  # the real model answers (greedy: its own text)
        assert "Paris" in done.stdout
        assert "[adaptive: " in done.stderr  # the statistics line
    else:  # the registry cannot be reached: the bundled pair, and the demo says why
        assert "the demo runs on the bundled 5M pair instead" in done.stderr
        assert "Prompt: def add(a, b):" in done.stdout
    assert list(temporary.iterdir()) == []  # socket, runtime dir and log are gone

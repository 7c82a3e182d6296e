"""Suite-wide settings (GPU tests skip, with the reason, when CUDA is absent; a test that starts
a process must be marked so) and the tiny models and arena many modules share (a module may
define its own under the same name)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tiny_models import DAEMON_CONTEXT, TINY_VOCAB, write_tiny_gguf_llama, write_tiny_pair

from hetspec.protocol import Arena


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch  # noqa: PLC0415 - only paid for when a GPU test was collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False here")
    for item in gpu_tests:
        item.add_marker(skip)


# The tiers (see the Makefile): `make check` runs what is marked neither `process` nor `slow`.
# A process marker cannot be forgotten: a test without it that starts a process (a daemon, a
# worker, a shell client: anything through subprocess, asyncio's included) fails, even where
# the code under test catches the error the start raises. A test that starts one only on a cold
# cache (a compiler behind torch.compile or triton, pip fetching a model) is marked too: here
# the cache may be warm, on CI it is not.
_running: pytest.Item | None = None
_spawned = pytest.StashKey[str]()
_execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]


def _guarded_execute_child(self, args, *rest, **kwargs):
    item = _running
    if item is not None and item.get_closest_marker("process") is None:
        item.stash[_spawned] = (
            f"{item.nodeid} starts a process ({args!r}) but is not marked `process`: mark it "
            "(a whole module: pytestmark = pytest.mark.process), so that make check leaves it out"
        )
        raise RuntimeError(item.stash[_spawned])
    return _execute_child(self, args, *rest, **kwargs)


subprocess.Popen._execute_child = _guarded_execute_child  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Setup, call and teardown of ``item`` (module fixtures it starts included) under the guard."""
    global _running  # noqa: PLW0603
    _running = item
    try:
        return (yield)
    finally:
        _running = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    message = item.stash.get(_spawned, None)
    if message is not None:  # reported once, in the phase that started the process
        del item.stash[_spawned]
        if report.passed:
            report.outcome, report.longrepr = "failed", message
    return report


@pytest.fixture(scope="session")
def heavy(tmp_path_factory: pytest.TempPathFactory):
    """heavy-100m with every GGUF type, built once per session (about 6 s on 2 cores)."""
    from hetspec.models.heavy import DEFAULT_TYPES, ensure_heavy  # noqa: PLC0415

    return ensure_heavy("100m", DEFAULT_TYPES, tmp_path_factory.mktemp("cache"), quiet=True)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """The tiny llama GGUF (vocabulary TINY_VOCAB)."""
    return write_tiny_gguf_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def arena(tmp_path):
    """A 4-slot arena for 16 rows of the tiny vocabulary."""
    name = f"/dev/shm/hetspec-test-{os.getpid()}-{tmp_path.name}"
    with Arena.create(name, 4, 16 * TINY_VOCAB * 4) as arena:
        yield arena


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The tiny pair the daemon tests serve, and "other": a draft with another tokenizer."""
    root = tmp_path_factory.mktemp("models")
    return write_tiny_pair(root, DAEMON_CONTEXT) | {
        "other": write_tiny_gguf_llama(
            root / "other", seed=1, layers=1, vocab_size=300, context=DAEMON_CONTEXT
        ),
    }


@pytest.fixture
def interpreted(monkeypatch):
    """The Triton matmul's kernels made for Triton's interpreter, on the CPU (for the tests of
    skinny_matmul.py and int8_weights.py); made afresh after the test."""
    from hetspec.workers.runtimes.torch_runtime import skinny_matmul  # noqa: PLC0415 (torch: only here)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    skinny_matmul._kernels.cache_clear()
    yield
    skinny_matmul._kernels.cache_clear()

"""A pair given as GGUF files alone (no Hugging Face folder), as most users' models come:
``hetspecd --target X.gguf --draft Y.gguf`` serves it without a configuration file, and the
``hetspecd.toml`` that ``hetspec models check`` prints for it starts the daemon as printed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_daemon import Daemon, native, request

from hetspec.daemon.config import BUNDLED_MODELS, ConfigError, load_config, model_paths_of

pytestmark = pytest.mark.process  # hetspecd or the shell client, for most

PROMPT = "def read_lines(path):\n"


def alone(tmp_path: Path) -> tuple[Path, Path]:
    """The bundled pair's Q8_0 GGUFs, each in a folder of its own with nothing beside it."""
    paths = []
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
        paths.append(shutil.copy(BUNDLED_MODELS / name / f"{name}-q8_0.gguf", tmp_path / name))
    return Path(paths[0]), Path(paths[1])


def greedy(daemon: Daemon, mode: str) -> str:
    status, body = request(
        daemon.socket,
        "POST",
        "/api/generate",
        native(PROMPT, max_tokens=40, temperature=0.0, mode=mode),
    )
    assert status == 200, body
    return body["response"]


def test_paths_name_their_exports(tmp_path) -> None:
    target, _ = alone(tmp_path)
    assert model_paths_of(target).folder == ""  # no config.json beside it
    assert model_paths_of(target.parent).gguf == str(target.resolve())  # a folder with one GGUF
    both = model_paths_of(BUNDLED_MODELS / "target" / "target-q8_0.gguf")
    assert both.folder == str((BUNDLED_MODELS / "target").resolve())
    for bad, said in (
        (tmp_path / "none", "no such file or folder"),
        (BUNDLED_MODELS / "target", "several GGUF files"),
        (BUNDLED_MODELS / "MODEL_CARD.md", "neither a model folder"),
    ):
        with pytest.raises(ConfigError, match=said):
            model_paths_of(bad)


def test_a_configuration_without_any_export_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="draft: give its folder, its gguf or both"):
        load_config(overrides={"draft.folder": "", "draft.gguf": ""}, environ={})
    with pytest.raises(ConfigError, match=r"draft\.gguf is empty, and the CPU worker loads it"):
        load_config(overrides={"draft.folder": str(BUNDLED_MODELS / "draft")}, environ={})


def test_hetspecd_serves_two_gguf_files_named_on_its_command_line(tmp_path) -> None:
    target, draft = alone(tmp_path)
    daemon = Daemon(
        tmp_path / "d",
        None,
        None,
        "--target",
        str(target),
        "--draft",
        str(draft),
        gpu_runtime="auto",
        context=1024,
    )
    try:
        daemon.wait_ready()
        _, status = request(daemon.socket, "GET", "/props")
        assert status["models"]["target"] == {"folder": "", "gguf": str(target.resolve())}
        _, tags = request(daemon.socket, "GET", "/v1/models")
        assert tags["data"][0]["id"] == "target-q8_0"  # the GGUF's name: there is no folder
        alone_text = greedy(daemon, "autoregressive")
        assert alone_text
        assert greedy(daemon, "adaptive") == alone_text
        log = daemon.log.read_text()
        assert "torch unusable: reads a model folder, and the target has none" in log
    finally:
        assert daemon.stop() == 0


def test_the_configuration_models_check_prints_starts_as_printed(tmp_path) -> None:
    target, draft = alone(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "hetspec.client.cli", "models", "check", str(target), str(draft)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    printed = done.stdout.split("hetspecd.toml:\n", 1)[1]
    config = tmp_path / "hetspecd.toml"
    config.write_text(printed)
    daemon = Daemon(
        tmp_path / "d", None, None, "--config", str(config), gpu_runtime="auto", context=1024
    )
    try:
        daemon.wait_ready()
        assert greedy(daemon, "adaptive") == greedy(daemon, "autoregressive")
    finally:
        assert daemon.stop() == 0


def test_a_torch_verifier_without_a_folder_is_one_clear_line(tmp_path) -> None:
    target, draft = alone(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetspec.daemon",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--socket",
            str(tmp_path / "s.sock"),
            "--runtime-dir",
            str(tmp_path / "run"),
            "--log-format",
            "console",
            "--set",
            'gpu_runtime="torch"',
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert (
        "the GPU worker's torch loads the target's folder, and target.folder is empty"
        in done.stderr
    )
    assert "Traceback" not in done.stderr


def test_bench_on_a_pair_it_must_skip_ends_in_one_line_not_a_traceback(tmp_path) -> None:
    target, _ = alone(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetspec.client.cli",
            "bench",
            "--target",
            str(target),
            "--draft",
            str(target),
            "--out",
            str(tmp_path / "out"),
            "--llama-server",
            "off",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1
    assert "the target and the draft are the same model" in done.stdout
    assert "nothing was measured: every target was skipped" in done.stderr
    assert "Traceback" not in done.stderr

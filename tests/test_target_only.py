"""A target without a draft model, as most users have one: ``hetspec models check TARGET`` says
what will run and prints a configuration that starts; hetspecd serves it on one worker,
drafting from the text itself where that pays, with the target's own greedy output."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from test_daemon import Daemon, native, request

from hetspec.daemon.config import BUNDLED_MODELS, load_config

pytestmark = pytest.mark.process  # hetspecd and the shell client

# code that repeats itself: what the target writes next follows what it wrote before
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul("


def generate(daemon: Daemon, mode: str, **options) -> tuple[int, dict]:
    body = native(PROMPT, max_tokens=64, temperature=0.0, mode=mode, **options)
    return request(daemon.socket, "POST", "/api/generate", body)


def test_a_target_named_alone_has_no_draft_model() -> None:
    target = str(BUNDLED_MODELS / "target" / "target-q8_0.gguf")
    assert load_config(overrides={"target.gguf": target}, environ={}).draft is None
    assert load_config(overrides={"draft": "none"}, environ={}).draft is None
    assert load_config(environ={}).draft is not None  # the bundled pair by default


def test_the_configuration_models_check_prints_for_a_target_alone_serves_it(tmp_path) -> None:
    target = tmp_path / "target"
    shutil.copytree(BUNDLED_MODELS / "target", target, ignore=shutil.ignore_patterns("*f16.gguf"))
    done = subprocess.run(
        [sys.executable, "-m", "hetspec.client.cli", "models", "check", str(target)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no draft model: one worker verifies" in done.stdout
    printed = done.stdout.split("hetspecd.toml:\n", 1)[1]
    assert "[draft]" not in printed
    config = tmp_path / "hetspecd.toml"
    config.write_text(printed)
    daemon = Daemon(
        tmp_path / "d", None, None, "--config", str(config), gpu_runtime="auto", context=1024
    )
    try:
        health = daemon.wait_ready()
        assert list(health["workers"]) == ["gpu"]  # one worker, the verifier
        _, props = request(daemon.socket, "GET", "/props")
        assert props["models"]["draft"] is None
        status, alone = generate(daemon, "autoregressive")
        assert status == 200, alone
        status, adaptive = generate(daemon, "adaptive")
        assert status == 200, adaptive
        assert adaptive["response"] == alone["response"]
        assert adaptive["speculative"]["rounds"] >= 1
        status, refused = generate(daemon, "sequential")
        assert status == 400
        assert "needs a draft model" in refused["error"]
        status, refused = generate(daemon, "adaptive", gamma=4)
        assert status == 400
        # bad input for the model-free drafter: served, with the target's own tokens
        for prompt in ("x", "the " * 600):  # one token; one token repeated hundreds of times
            body = native(prompt, max_tokens=48, temperature=0.0, mode="autoregressive")
            status, alone = request(daemon.socket, "POST", "/api/generate", body)
            assert status == 200, alone
            body["mode"] = "adaptive"
            status, adaptive = request(daemon.socket, "POST", "/api/generate", body)
            assert status == 200, adaptive
            assert adaptive["tokens"] == alone["tokens"]
        # the context full to its last slot: the rounds shrink to fit, nothing is lost
        body = native("the " * 900, max_tokens=-1, temperature=0.0, mode="adaptive")
        status, full = request(daemon.socket, "POST", "/api/generate", body)
        assert status == 200, full
        assert full["done_reason"] in ("length", "stop")
        assert full["prompt_eval_count"] + full["eval_count"] <= 1024
    finally:
        assert daemon.stop() == 0

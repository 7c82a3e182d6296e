"""hetspecd serving requests through FlowSpec's pipeline (``[pipeline]``): the bundled
target's layers in two stage processes the daemon runs and supervises (split after layer 1's
attention), the bundled draft model drafting in the CPU worker.

Greedy output is the target's own, in the speculative modes (FlowSpec's schedule) and in
autoregressive mode (the plain pipeline); a seed gives the same text in both; a killed stage
fails the request within 2 s, is back within 8 s, and the next request succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_daemon import request
from test_lossless import BundledDaemon

from hetspec.bench.compare import prompt_set
from hetspec.daemon.config import BUNDLED_MODELS

pytestmark = pytest.mark.process  # a daemon with stage processes, for most

TOKENS = 24


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    daemon = BundledDaemon(
        tmp_path_factory.mktemp("pipeline"),
        "draft-cpu",
        "--set",
        'pipeline.local=["0:1.5", "1.5:4"]',
        "--set",
        "pipeline.timeout_s=1.5",
        # a stage comes back after the request that found it dead has
        # failed (not within its 1.5 s, where the request would succeed)
        "--set",
        "restart_backoff_s=[2.0, 5.0]",
    )
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def target():
    from hetspec.workers.runtimes.torch_runtime import TorchRuntime  # noqa: PLC0415

    return TorchRuntime(BUNDLED_MODELS / "target", max_context=1024, verifies=True)


def greedy(target, prompt: str) -> list[int]:
    target.prefill(target.tokenize(prompt))
    tokens = [int(target.last_logits().argmax())]
    while len(tokens) < TOKENS:
        target.append(tokens[-1:])
        tokens.append(int(target.last_logits().argmax()))
    return tokens


def test_health_shows_the_stages_the_daemon_runs(daemon) -> None:
    status, health = request(daemon.socket, "GET", "/health")
    assert status == 200
    assert [s["layers"] for s in health["pipeline"]["local"]] == ["0:1.5", "1.5:4"]
    assert all(s["alive"] for s in health["pipeline"]["local"])
    assert list(health["workers"]) == ["cpu"]  # no verifier worker: the stages verify
    _, props = request(daemon.socket, "GET", "/props")
    assert props["devices"]["target"] == "pipeline"
    assert props["devices"]["draft"].startswith("cpu")  # llama.cpp or the native kernels
    assert props["pipeline"] == health["pipeline"]


def test_greedy_output_through_the_pipeline_is_the_targets_own(daemon, target) -> None:
    options = {"max_tokens": TOKENS, "ignore_eos": True}
    accepted = 0
    for prompt in prompt_set(6)[:6]:
        expected = greedy(target, prompt)
        for mode in ("adaptive", "autoregressive"):
            body = daemon.generate(prompt, mode=mode, **options)
            assert body["tokens"] == expected, (mode, prompt)
        accepted += body["timings"]["predicted_n"] > 0
    assert accepted == 6


def test_a_seed_gives_the_same_text_drafting_or_not(daemon) -> None:
    options = {"max_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0, "seed": 7}
    prompt = "def parse(text):\n"
    texts = {
        mode: daemon.generate(prompt, mode=mode, **options)["tokens"]
        for mode in ("adaptive", "autoregressive")
    }
    assert texts["adaptive"] == texts["autoregressive"]
    other = daemon.generate(prompt, mode="adaptive", **(options | {"seed": 8}))["tokens"]
    assert other != texts["adaptive"]


def test_logprobs_are_refused_clearly(daemon) -> None:
    body = {"model": "x", "prompt": "a", "stream": False, "logprobs": True}
    status, body = request(daemon.socket, "POST", "/api/generate", body)
    assert status == 400
    assert "pipeline" in body["error"]


def test_a_killed_stage_fails_the_request_quickly_and_comes_back(daemon, target) -> None:
    _, health = request(daemon.socket, "GET", "/health")
    os.kill(health["pipeline"]["local"][1]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    status, body = request(
        daemon.socket,
        "POST",
        "/api/generate",
        {
            "model": "x",
            "prompt": "def f(x):\n",
            "stream": False,
            "options": {"num_predict": TOKENS},
        },
    )
    assert status == 503, body
    assert time.monotonic() - killed < 2.0
    while True:
        _, health = request(daemon.socket, "GET", "/health")
        if all(s["alive"] for s in health["pipeline"]["local"]) and health["pipeline"]["restarts"]:
            break  # (the first restart of this daemon)
        assert time.monotonic() - killed < 8.0, health
        time.sleep(0.05)
    prompt = "def area(r):\n"
    body = daemon.generate(prompt, max_tokens=TOKENS, ignore_eos=True)
    assert body["tokens"] == greedy(target, prompt)
    # restarted once: the failed request's silent stage was the killed one, never the
    # process that replaced it meanwhile (which never had that request's Reset)
    _, health = request(daemon.socket, "GET", "/health")
    assert health["pipeline"]["restarts"] == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"pipeline": {"stages": [{"endpoint": "tcp://10.0.0.2:5601", "key": "/k"}]}},
            "stages on other hosts need the coordinator's key",
        ),
        (
            {"pipeline": {"key": "/k", "stages": [{"endpoint": "10.0.0.2:5601", "key": "/k"}]}},
            "not a tcp:// endpoint",
        ),
        ({"pipeline": {"local": ["0:4"], "timeout_s": 0}}, "timeout_s must be in"),
        ({"pipeline": {"local": ["0:4"]}, "placement": "draft-gpu"}, 'placement = "draft-cpu"'),
    ],
)
def test_a_pipeline_setting_that_cannot_work_is_one_clear_line(overrides, message) -> None:
    from hetspec.daemon.config import ConfigError, load_config  # noqa: PLC0415

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(environ={}, overrides=overrides)


def test_local_stages_that_do_not_follow_each_other_stop_the_daemon(tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetspec.daemon",
            "--socket",
            str(tmp_path / "s.sock"),
            "--runtime-dir",
            str(tmp_path / "run"),
            "--log-format",
            "console",
            "--set",
            'pipeline.local=["0:1", "2:4"]',
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert "not consecutive ranges from layer 0" in result.stdout + result.stderr


def test_a_stage_on_another_host_admits_the_daemons_one_key(tmp_path, target) -> None:
    """A stage the daemon does not run (as on another host: its own key pair, admitting only
    the coordinator's public key) after the daemon's local stage, which uses the
    coordinator's key to reach it."""
    from hetspec.daemon.pipeline.local_stages import free_port  # noqa: PLC0415
    from hetspec.protocol.curve_keys import make_keys  # noqa: PLC0415

    keys, admitted = tmp_path / "keys", tmp_path / "admitted"
    make_keys(keys, ["coordinator", "stage1"])
    admitted.mkdir()
    (admitted / "coordinator.key").write_bytes((keys / "coordinator.key").read_bytes())
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log = (tmp_path / "stage1.log").open("w")
    stage = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hetspec.workers.stage",
            "serve",
            "--model",
            str(BUNDLED_MODELS / "target"),
            "--layers",
            "1.5:4",
            "--bind",
            endpoint,
            "--key",
            str(keys / "stage1.key_secret"),
            "--authorized",
            str(admitted),
            "--threads",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 60  # bound before the daemon picks its free ports
        while " at tcp://" not in (tmp_path / "stage1.log").read_text():
            assert stage.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.05)
        remote = f'[{{endpoint = "{endpoint}", key = "{keys / "stage1.key"}"}}]'
        secret = keys / "coordinator.key_secret"
        (tmp_path / "daemon").mkdir()
        daemon = BundledDaemon(
            tmp_path / "daemon",
            "draft-cpu",
            "--set",
            'pipeline.local=["0:1.5"]',
            "--set",
            "pipeline.timeout_s=10",  # (a busy test box)
            "--set",
            f"pipeline.stages={remote}",
            "--set",
            f'pipeline.key="{secret}"',
        )
        try:
            prompt = "def mean(values):\n"
            body = daemon.generate(prompt, max_tokens=TOKENS, ignore_eos=True)
            assert body["tokens"] == greedy(target, prompt)
            _, health = request(daemon.socket, "GET", "/health")
            assert health["pipeline"]["remote"] == [endpoint]
        finally:
            daemon.stop()
    finally:
        stage.kill()
        stage.wait()
        log.close()


def test_a_request_that_would_fill_the_stages_caches_is_refused_up_front(daemon) -> None:
    """The stages hold 2048 slots, some kept for the tree in flight: a request for 2040 more
    tokens than its prompt is a 400 that says so, before any stage computes."""
    body = {
        "model": "x",
        "prompt": "def f(x):\n",
        "stream": False,
        "options": {"num_predict": 2040},
    }
    status, answer = request(daemon.socket, "POST", "/api/generate", body)
    assert status == 400
    assert "room for a draft tree" in answer["error"]


def test_a_hung_stage_is_killed_and_restarted(daemon, target) -> None:
    """A stage that is alive but answers nothing (stopped): the request fails within 2 s,
    the daemon kills and restarts the stage, and a request after that succeeds."""
    _, health = request(daemon.socket, "GET", "/health")
    hung, restarts = health["pipeline"]["local"][0]["pid"], health["pipeline"]["restarts"]
    os.kill(hung, signal.SIGSTOP)
    stopped = time.monotonic()
    body = {
        "model": "x",
        "prompt": "def g(x):\n",
        "stream": False,
        "options": {"num_predict": TOKENS},
    }
    status, answer = request(daemon.socket, "POST", "/api/generate", body)
    assert status == 503, answer
    assert "did not answer" in answer["error"]
    assert time.monotonic() - stopped < 2.0
    while True:
        _, health = request(daemon.socket, "GET", "/health")
        if health["pipeline"]["restarts"] > restarts:  # the watcher saw it serve again
            break
        assert time.monotonic() - stopped < 12.0, health
        time.sleep(0.05)
    prompt = "def total(xs):\n"
    body = daemon.generate(prompt, max_tokens=TOKENS, ignore_eos=True)
    assert body["tokens"] == greedy(target, prompt)

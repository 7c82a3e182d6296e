"""The real hetspecd with real worker processes: handshake, refusal, restart, drain, cleanup."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tiny_models import DAEMON_CONTEXT

from hetspec.client.daemon_process import DaemonProcess
from hetspec.client.types import generate_body
from hetspec.daemon.decode import round_log
from hetspec.daemon.instance import Instance
from hetspec.protocol.arena import SHM_DIR
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.workers.runtimes.torch_runtime import TorchRuntime

pytestmark = pytest.mark.process

CONTEXT = DAEMON_CONTEXT
MODES = ("sequential", "parallel", "adaptive")  # the speculative ones
STARTUP_TIMEOUT = 120


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float = 60) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def request(sock: Path, method: str, path: str, body: dict | None = None):
    connection = UnixHTTPConnection(sock)
    connection.request(method, path, json.dumps(body) if body is not None else None)
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def native(prompt: str, **options) -> dict:
    """An /api/generate body (Ollama's) for the client library's options, not streamed."""
    return generate_body(prompt, options, stream=False)


def stream(sock: Path, body: dict):
    """An open NDJSON stream: (connection, response); read lines with response.readline()."""
    connection = UnixHTTPConnection(sock)
    connection.request("POST", "/api/generate", json.dumps({**body, "stream": True}))
    response = connection.getresponse()
    assert response.status == 200
    return connection, response


def clean_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without its HETSPEC_ settings (a developer's shell must not configure
    the daemons under test), and ``env``."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HETSPEC_")} | (env or {})


class Daemon(DaemonProcess):
    def __init__(
        self,
        tmp_path: Path,
        target: Path | None,
        draft: Path | None,
        *extra: str,
        env: dict[str, str] | None = None,
        launcher: list[str] | None = None,
        pass_fds: tuple[int, ...] = (),
        gpu_runtime: str = "torch",
        context: int = CONTEXT,
    ) -> None:
        """hetspecd on ``target`` and ``draft`` (GGUF files, each with its folder: the file's
        own; None: the models ``extra`` names, or the configuration's), the GPU worker in
        ``gpu_runtime`` ("auto": measured at load)."""
        exports = {
            (name, kind): path.parent if kind == "folder" else path
            for name, path in (("target", target), ("draft", draft))
            if path is not None
            for kind in ("folder", "gguf")
        }
        settings = {
            **{f"{name}.{kind}": str(path) for (name, kind), path in exports.items()},
            "cpu_worker.n_ctx": context,
            "gpu_worker.max_context": context,
            "heartbeat_timeout_s": 5,
            "restart_backoff_s": [0.2, 2],
        }
        # the torch verifier these tests mean, not one measured at load (test_runtime_choice)
        argv = ["--log-format", "json", "--set", f"gpu_runtime={json.dumps(gpu_runtime)}", *extra]
        for key, value in settings.items():
            argv += ["--set", f"{key}={json.dumps(value)}"]
        super().__init__(
            tmp_path, *argv, env=clean_env(env), launcher=launcher or (), pass_fds=pass_fds
        )

    def wait_ready(self) -> dict:
        return super().wait_ready(STARTUP_TIMEOUT)

    def health(self) -> dict:
        return request(self.socket, "GET", "/health")[1]


def target_greedy(gguf: Path, prompt: str, count: int) -> np.ndarray:
    """The target model's own greedy continuation, from the torch runtime in this process."""
    target = TorchRuntime(gguf.parent, max_context=256)
    target.prefill(target.tokenize(prompt))
    return target.draft(count + 1, SamplingParams(), DrawnSampler(0)).tokens[0, :count]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def segments(runtime_dir: Path) -> list[Path]:
    return list(SHM_DIR.glob(f"{Instance(runtime_dir).name}-*"))


@pytest.fixture
def daemon(tmp_path, models):
    daemon = Daemon(tmp_path, models["target"], models["draft"])
    yield daemon
    daemon.stop()


def test_the_ready_daemon_serves_the_targets_own_greedy_output(daemon, models) -> None:
    health = daemon.wait_ready()
    assert set(health["workers"]) == {"cpu", "gpu"}
    assert health["workers"]["gpu"]["model"] == str(models["target"].parent)
    assert health["workers"]["cpu"]["model"] == str(models["draft"])
    cpu, gpu = health["workers"]["cpu"], health["workers"]["gpu"]
    assert not set(cpu["cores"]) & set(gpu["cores"]) or len(os.sched_getaffinity(0)) == 1
    if gpu["device"] == "cpu" and len(os.sched_getaffinity(0)) >= 2:  # the target may borrow
        assert (gpu["spare_cores"], cpu["spare_cores"]) == (cpu["cores"], [])
        # and the daemon works beside the drafter, not on its cores
        off_drafter = os.sched_getaffinity(0) - set(cpu["cores"])
        assert set(health["daemon"]["cores"]) == off_drafter
        assert os.sched_getaffinity(health["daemon"]["pid"]) == off_drafter

    prompt = "def load(path):\n"
    status, body = request(
        daemon.socket,
        "POST",
        "/api/generate",
        native(prompt, max_tokens=24, ignore_eos=True),
    )
    assert status == 200, body
    target = TorchRuntime(models["target"].parent, max_context=64)
    target.prefill(target.tokenize(prompt))
    expected = target.draft(25, SamplingParams(), DrawnSampler(0)).tokens[0, :24]
    assert body["tokens"] == expected.tolist()
    assert body["timings"]["predicted_n"] == 24
    assert body["response"] == b"".join(target.token_bytes(t) for t in expected).decode(
        errors="replace"
    )

    shell = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetspec.client.cli",
            "--socket",
            str(daemon.socket),
            "generate",
            prompt,
            "--max-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.startswith(body["response"][:10])
    assert "tokens/s" in shell.stderr

    status, error = request(daemon.socket, "POST", "/api/generate", native("x", top_p=0))
    assert status == 400
    assert "top_p must be in (0, 1]" in error["error"]
    # the configured mode is adaptive, which chooses gamma itself
    status, error = request(daemon.socket, "POST", "/api/generate", native("x", gamma=3))
    assert status == 400
    assert "gamma fixes the draft length, which mode 'adaptive' does not use" in error["error"]
    status, error = request(daemon.socket, "POST", "/api/generate", native("x", mode="x"))
    assert status == 400
    assert "mode must be one of autoregressive, sequential, parallel, adaptive" in error["error"]


@pytest.mark.parametrize("draft", ["draft", "target"])
def test_speculative_greedy_output_is_the_targets_own(tmp_path, models, draft) -> None:
    """With a different draft (mostly rejected) and with the target as its own draft (always
    accepted), fixed and adaptive gamma, with and without branches: the target's tokens."""
    rounds_file = tmp_path / "rounds.jsonl"
    daemon = Daemon(
        tmp_path,
        models["target"],
        models[draft],
        "--set",
        f"round_log={json.dumps(str(rounds_file))}",
    )
    rounds = Counter()
    try:
        daemon.wait_ready()
        prompts = [
            "import os\n",
            "class Point:\n    def __init__(self",
            "# héllo\n",
            "x = [",
            "def",
        ]
        accepted = 0
        for (index, prompt), mode in itertools.product(enumerate(prompts), MODES):
            fixed = index % 2 == 0 and mode != "adaptive"
            options = {"gamma": 1 + index} if fixed else {}
            status, body = request(
                daemon.socket,
                "POST",
                "/api/generate",
                native(prompt, max_tokens=40, ignore_eos=True, mode=mode, **options),
            )
            assert status == 200, body
            expected = target_greedy(models["target"], prompt, 40).tolist()
            assert body["tokens"] == expected, (prompt, mode)
            accepted += body["timings"]["draft_n_accepted"]
            assert body["speculative"]["rounds"] >= 1
            rounds[mode] += body["speculative"]["rounds"]
        if draft == "target":
            assert accepted >= 100
    finally:
        assert daemon.stop() == 0
    # the round log has every round, each with its plan (the controller's expectation where
    # it chose the plan) and its report
    lines = round_log.read(rounds_file)
    assert Counter(line.mode for line in lines) == rounds
    assert sum(line.emitted for line in lines) + len(prompts) * len(MODES) == 40 * len(
        prompts
    ) * len(MODES)
    # before anything was measured the controller expects nothing of a plan: its first
    # rounds (one and two tokens: a drafter whose catch-up yields the first token measures
    # its step from the second), the next chosen while the first one ran
    adaptive = [line for line in lines if line.mode == "adaptive"]
    unpriced = [index for index, line in enumerate(adaptive) if line.plan.round_s <= 0]
    assert unpriced == list(range(len(unpriced)))
    assert 2 <= len(unpriced) <= 4
    assert len(adaptive) > len(unpriced)
    assert "| adaptive |" in round_log.summary(lines)


def test_sampled_speculative_output_is_reproducible_by_seed(daemon) -> None:
    """With a fixed gamma: an adaptive one draws random numbers in an order that depends on
    the controller's timing-driven choices."""
    daemon.wait_ready()
    for mode in ("sequential", "parallel"):
        runs = [
            request(
                daemon.socket,
                "POST",
                "/api/generate",
                native(
                    "import os\n",
                    max_tokens=30,
                    temperature=0.9,
                    top_k=50,
                    ignore_eos=True,
                    gamma=3,
                    seed=seed,
                    mode=mode,
                ),
            )[1]["tokens"]
            for seed in (1, 1, 2)
        ]
        assert runs[0] == runs[1], mode
        assert runs[0] != runs[2], mode


def test_a_draft_with_another_tokenizer_is_refused_naming_both_models(tmp_path, models) -> None:
    daemon = Daemon(tmp_path, models["target"], models["other"])
    assert daemon.process.wait(timeout=STARTUP_TIMEOUT) == 1
    log = daemon.log.read_text()
    assert "do not share a tokenizer" in log
    assert str(models["other"]) in log
    assert str(models["target"].parent) in log
    assert not segments(daemon.runtime_dir)
    assert not daemon.socket.exists()


def test_a_killed_worker_fails_its_request_fast_and_is_restarted(daemon) -> None:
    health = daemon.wait_ready()
    gpu_pid = health["workers"]["gpu"]["pid"]
    body = native("import os\n", max_tokens=3000, ignore_eos=True)
    connection, response = stream(daemon.socket, body)
    assert "response" in json.loads(response.readline())
    os.kill(gpu_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    lines = [json.loads(line) for line in iter(response.readline, b"")]
    assert time.monotonic() - killed_at < 2
    final = lines[-1]
    assert final["done_reason"] == "error"
    assert "gpu worker was killed by SIGKILL" in final["error"]
    assert len(final["tokens"]) < 3000
    connection.close()

    restarted = daemon.wait_ready()
    assert restarted["workers"]["gpu"]["restarts"] == 1
    assert restarted["workers"]["gpu"]["pid"] != gpu_pid
    status, again = request(
        daemon.socket,
        "POST",
        "/api/generate",
        native("import os\n", max_tokens=8),
    )
    assert status == 200
    assert again["done"] is True


def test_a_seeded_request_cut_by_a_worker_restart_gives_the_same_text_again(daemon) -> None:
    """Keyed sampling: the tokens a killed worker cut short begin the text the retry gives,
    and the retry on the restarted workers gives the text the request gave before."""
    gpu_pid = daemon.wait_ready()["workers"]["gpu"]["pid"]
    body = native(
        "import os\n",
        max_tokens=2000,
        ignore_eos=True,
        seed=31,
        temperature=0.9,
        top_p=0.95,
        mode="adaptive",
    )
    status, before = request(daemon.socket, "POST", "/api/generate", body)
    assert status == 200
    connection, response = stream(daemon.socket, body)
    assert "response" in json.loads(response.readline())
    os.kill(gpu_pid, signal.SIGKILL)
    cut = [json.loads(line) for line in iter(response.readline, b"")][-1]
    connection.close()
    assert cut["done_reason"] == "error"
    assert 0 < len(cut["tokens"]) < len(before["tokens"])
    assert cut["tokens"] == before["tokens"][: len(cut["tokens"])]
    assert daemon.wait_ready()["workers"]["gpu"]["pid"] != gpu_pid
    status, again = request(daemon.socket, "POST", "/api/generate", body)
    assert status == 200
    assert (again["tokens"], again["response"]) == (before["tokens"], before["response"])


def test_sigterm_lets_the_request_finish_and_leaves_nothing_behind(daemon) -> None:
    health = daemon.wait_ready()
    workers = [w["pid"] for w in health["workers"].values()]
    assert segments(daemon.runtime_dir)
    connection, response = stream(
        daemon.socket, native("class A:\n", max_tokens=1500, ignore_eos=True)
    )
    json.loads(response.readline())
    daemon.process.send_signal(signal.SIGTERM)
    lines = [json.loads(line) for line in iter(response.readline, b"")]
    connection.close()
    assert lines[-1]["done_reason"] == "length"
    assert len(lines[-1]["tokens"]) == 1500
    assert daemon.process.wait(timeout=60) == 0
    assert not any(pid_alive(pid) for pid in workers)
    assert not segments(daemon.runtime_dir)
    assert not daemon.socket.exists()
    assert not list(daemon.runtime_dir.glob("*.sock"))


def test_sighup_drains_like_sigterm_and_exits_to_be_restarted(daemon) -> None:
    """A reload (systemctl reload sends HUP): the streaming request ends whole, nothing is
    left behind, and the exit status is the one the unit restarts on without calling it a
    failure (SuccessExitStatus and RestartForceExitStatus)."""
    from hetspec.daemon.service import RELOAD_EXIT_STATUS  # noqa: PLC0415

    daemon.wait_ready()
    connection, response = stream(
        daemon.socket, native("class A:\n", max_tokens=600, ignore_eos=True)
    )
    json.loads(response.readline())
    daemon.process.send_signal(signal.SIGHUP)
    lines = [json.loads(line) for line in iter(response.readline, b"")]
    connection.close()
    assert lines[-1]["done_reason"] == "length"
    assert len(lines[-1]["tokens"]) == 600
    assert daemon.process.wait(timeout=60) == RELOAD_EXIT_STATUS == 75
    assert "reload asked (SIGHUP)" in daemon.log.read_text()
    assert not segments(daemon.runtime_dir)
    assert not daemon.socket.exists()
    unit = (Path(__file__).resolve().parents[1] / "systemd" / "hetspecd.service").read_text()
    assert "ExecReload=/bin/kill -HUP $MAINPID" in unit
    assert "SuccessExitStatus=75" in unit
    assert "RestartForceExitStatus=75" in unit


def test_a_restart_removes_what_a_killed_instance_left(tmp_path, models) -> None:
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)  # hetspecd refuses a directory others may write
    stale = SHM_DIR / f"{Instance(runtime_dir).name}-999999-arena"
    stale.write_bytes(b"x" * 4096)
    (runtime_dir / "gpu-7-commands.sock").write_text("")
    daemon = Daemon(tmp_path, models["target"], models["draft"])
    try:
        daemon.wait_ready()
        assert not stale.exists()
        assert not (runtime_dir / "gpu-7-commands.sock").exists()
        second = Daemon(
            tmp_path / "second",
            models["target"],
            models["draft"],
            "--runtime-dir",
            str(runtime_dir),
        )
        assert second.process.wait(timeout=60) == 1
        assert "another hetspecd" in second.log.read_text()
    finally:
        stale.unlink(missing_ok=True)
        assert daemon.stop() == 0


def test_bad_configuration_is_one_clear_line(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hetspec.daemon", "--set", "cpu_worker.n_batch=lots"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HETSPEC_CONFIG": ""},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hetspecd: bad configuration: cpu_worker.n_batch: expected `int`, got `str` "
        "(--set cpu_worker.n_batch)"
    ]

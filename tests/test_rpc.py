"""llama.cpp's RPC backend: the target's layers on another host's rpc-server (here, a real
`hetspec-rpc-server` process on the loopback interface), the server's guards, the daemon's
`[rpc]` settings."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hetspec.daemon.config import BUNDLED_MODELS, ConfigError, load_config
from hetspec.daemon.pipeline.local_stages import DelayLink, LocalRpcServers
from hetspec.daemon.supervision.supervisor import worker_specs
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppError, LlamaCppRuntime

TARGET = BUNDLED_MODELS / "target" / "target-q8_0.gguf"
PROMPT = "def read_lines(path):\n    with open(path) as"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RpcServer:
    """`hetspec-rpc-server` on a free loopback port, ready once it accepts connections."""

    def __init__(self, threads: int = 1) -> None:
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hetspec.workers.rpc_server",
                "--port",
                str(self.port),
                "--threads",
                str(threads),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stdout.read()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise AssertionError("hetspec-rpc-server never listened")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def rpc_server():
    server = RpcServer()
    yield server
    server.stop()


def greedy(runtime: LlamaCppRuntime, tokens: int) -> tuple[np.ndarray, list[int]]:
    runtime.prefill(runtime.tokenize(PROMPT))
    logits = runtime.last_logits().copy()
    return logits, runtime.draft(tokens, SamplingParams(), DrawnSampler(0)).tokens[0].tolist()


@pytest.mark.process
@pytest.mark.parametrize("layers", [2, -1])
def test_layers_on_an_rpc_server_compute_what_this_box_computes(rpc_server, layers) -> None:
    """Some layers (or all and the output layer) on the server: the same llama.cpp CPU
    kernels over the same graph, so the same logits bit for bit and the same greedy text."""
    local = LlamaCppRuntime(TARGET, n_ctx=256, threads=1)
    expected_logits, expected_tokens = greedy(local, 16)
    local.close()
    remote = LlamaCppRuntime(
        TARGET, n_ctx=256, threads=1, gpu_layers=layers, rpc_servers=(rpc_server.endpoint,)
    )
    assert remote.offloaded
    logits, tokens = greedy(remote, 16)
    remote.close()
    assert tokens == expected_tokens
    np.testing.assert_array_equal(logits, expected_logits)


def test_an_unreachable_rpc_server_is_one_clear_error() -> None:
    port = free_port()  # nobody listens here
    with pytest.raises(LlamaCppError, match=rf"cannot reach the rpc-server at 127.0.0.1:{port}"):
        LlamaCppRuntime(
            TARGET, n_ctx=256, threads=1, gpu_layers=-1, rpc_servers=(f"127.0.0.1:{port}",)
        )


@pytest.mark.parametrize("endpoint", ["127.0.0.1", "host:0", "[::1]:50052"])
def test_a_malformed_rpc_endpoint_is_refused_before_llama_cpp_sees_it(endpoint) -> None:
    with pytest.raises(LlamaCppError, match="rpc server"):
        LlamaCppRuntime(TARGET, n_ctx=256, threads=1, gpu_layers=-1, rpc_servers=(endpoint,))


@pytest.mark.process
def test_the_server_refuses_an_open_address_unless_told_and_then_warns() -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "hetspec.workers.rpc_server", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert refused.returncode == 2
    assert "not a loopback address" in refused.stderr
    assert "--allow-remote" in refused.stderr
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hetspec.workers.rpc_server",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
            "--threads",
            "1",
            "--allow-remote",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = server.stderr.readline()
        assert "WARNING" in first
        assert "no authentication" in first
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_the_rpc_settings_reach_only_the_verifiers_llama_cpp(tmp_path: Path) -> None:
    config_file = tmp_path / "hetspecd.toml"
    config_file.write_text('[rpc]\nservers = ["10.0.0.2:50052", "box3:50052"]\nlayers = 6\n')
    config = load_config(config_file, environ={})
    specs = worker_specs(config, "json", gpu_runtime="llama.cpp")  # draft-cpu: GPU verifies
    assert specs["gpu"].settings.rpc_servers == ("10.0.0.2:50052", "box3:50052")
    assert specs["gpu"].settings.gpu_layers == 6
    assert specs["cpu"].settings.rpc_servers == ()  # the drafter stays on this box
    config = load_config(config_file, overrides={"placement": "draft-gpu"}, environ={})
    specs = worker_specs(config, "json", gpu_runtime="torch")  # draft-gpu: the CPU verifies
    assert specs["cpu"].settings.rpc_servers == ("10.0.0.2:50052", "box3:50052")


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[rpc]\nservers = ["10.0.0.2"]\n', "HOST:PORT"),
        ('[rpc]\nservers = ["[fe80::1]:50052"]\n', "not IPv6"),
        ('[rpc]\nservers = ["a:1", "a:1"]\n', "listed twice"),
        ('[rpc]\nservers = ["a:1"]\nlayers = -2\n', "layers must be"),
        ('gpu_runtime = "torch"\n[rpc]\nservers = ["a:1"]\n', "cannot use rpc.servers"),
    ],
)
def test_bad_rpc_settings_are_one_line_naming_the_key(tmp_path: Path, toml, message) -> None:
    config_file = tmp_path / "hetspecd.toml"
    config_file.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        load_config(config_file, environ={})


@pytest.fixture
def event_loop_thread():
    """An asyncio loop running in a thread: the delaying links serve on it while the test's
    llama.cpp calls block this thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def test_a_delaying_link_delivers_every_chunk_in_order_after_its_delay(event_loop_thread):
    """The relay the pipeline bench puts in front of llama.cpp's rpc-servers: an echo server
    behind a 40 ms link answers after two crossings, with every byte, in order."""
    echo = socket.create_server(("127.0.0.1", 0))
    port = echo.getsockname()[1]

    def serve() -> None:
        connection, _ = echo.accept()
        with connection:
            while data := connection.recv(1 << 16):
                connection.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    link = DelayLink(port, 40)
    asyncio.run_coroutine_threadsafe(link.start(), event_loop_thread).result(5)
    try:
        with socket.create_connection(("127.0.0.1", link.port), timeout=5) as client:
            payload = bytes(range(256)) * 64
            start = time.perf_counter()
            for offset in range(0, len(payload), 4096):
                client.sendall(payload[offset : offset + 4096])
            received = b""
            while len(received) < len(payload):
                received += client.recv(1 << 16)
            elapsed = time.perf_counter() - start
        assert received == payload
        assert elapsed >= 0.08  # there and back
    finally:
        asyncio.run_coroutine_threadsafe(link.aclose(), event_loop_thread).result(5)
        echo.close()


@pytest.mark.process
def test_two_rpc_servers_behind_slow_links_compute_the_same(tmp_path, event_loop_thread):
    """llama.cpp splits every layer over two servers, each behind a 5 ms link: the same greedy
    text as this box alone, each token paying the links."""
    local = LlamaCppRuntime(TARGET, n_ctx=256, threads=1)
    _, expected = greedy(local, 8)
    local.close()
    servers = LocalRpcServers(tmp_path, 2, link_ms=5)
    try:
        servers.wait()
        asyncio.run_coroutine_threadsafe(servers.start_links(), event_loop_thread).result(5)
        remote = LlamaCppRuntime(
            TARGET, n_ctx=256, threads=1, gpu_layers=-1, rpc_servers=tuple(servers.endpoints)
        )
        start = time.perf_counter()
        _, tokens = greedy(remote, 8)
        elapsed = time.perf_counter() - start
        remote.close()
    finally:
        asyncio.run_coroutine_threadsafe(servers.close_links(), event_loop_thread).result(5)
        servers.stop()
    assert tokens == expected
    assert elapsed >= 8 * 2 * 0.005  # at least a crossing each way per token

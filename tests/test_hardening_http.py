"""Issue 18, the HTTP side: what any local user (or a TCP client without the token) can do to
hetspecd's HTTP server, its log and its metrics. A real daemon on tiny models, reached over its
real socket with raw bytes; loopback only; every wait bounded."""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_daemon import CONTEXT, Daemon, native, stream
from test_systemd import UNITS, unit_settings
from tiny_models import write_tiny_gguf_llama

from hetspec.daemon.api.guard import RESERVED_FDS, descriptor_shortfall
from hetspec.daemon.cli import build_parser
from hetspec.daemon.config import ConfigError, DaemonConfig, load_config
from hetspec.logs import RateLimit

pytestmark = pytest.mark.process  # a real daemon, or a logging process, for most

TOKEN = "hardening-token-0123456789abcdef"
MAX_CONNECTIONS = 6
IDLE_TIMEOUT_S = 3.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def token_file(folder: Path, mode: int) -> Path:
    path = folder / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    target = write_tiny_gguf_llama(root / "target", seed=0, layers=2, context=CONTEXT)
    draft = write_tiny_gguf_llama(root / "draft", seed=1, layers=1, context=CONTEXT)
    port = free_port()
    daemon = Daemon(
        root / "daemon",
        target,
        draft,
        "--set",
        f'tcp.listen="127.0.0.1:{port}"',
        "--set",
        f'tcp.token_file="{token_file(root, 0o600)}"',
        "--set",
        f"http_max_connections={MAX_CONNECTIONS}",
        "--set",
        f"http_idle_timeout_s={IDLE_TIMEOUT_S}",
    )
    daemon.port = port
    daemon.wait_ready()
    yield daemon
    assert daemon.stop() == 0


def unix(daemon) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(10)
    connection.connect(str(daemon.socket))
    return connection


def tcp(daemon) -> socket.socket:
    return socket.create_connection(("127.0.0.1", daemon.port), timeout=10)


def exchange(connection: socket.socket, raw: bytes) -> bytes:
    """Send ``raw`` and read until the server closes (every request here says so or is bad)."""
    with connection:
        connection.sendall(raw)
        return read_all(connection)


def read_all(connection: socket.socket) -> bytes:
    answer = b""
    while chunk := connection.recv(65536):
        answer += chunk
    return answer


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def get(path: str, *headers: bytes) -> bytes:
    return b"\r\n".join(
        [
            f"GET {path} HTTP/1.1".encode(),
            b"Host: hetspecd",
            b"Connection: close",
            *headers,
            b"",
            b"",
        ]
    )


def log_since(daemon, offset: int) -> list[dict]:
    text = daemon.log.read_bytes()[offset:].decode()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# ----------------------------------------------------------------- 2: the bearer token


def test_a_token_that_is_not_utf8_is_refused_and_no_secret_reaches_the_log(daemon) -> None:
    offset = daemon.log.stat().st_size
    for given in (b"Bearer \xff", b"Bearer " + TOKEN.encode()[:-1] + b"\xff", b"\xfe\xff"):
        answer = exchange(tcp(daemon), get("/health", b"Authorization: " + given))
        assert status_of(answer) == 401, answer
        assert b"bearer token" in answer
    assert status_of(exchange(tcp(daemon), get("/health"))) == 401
    right = exchange(tcp(daemon), get("/health", f"Authorization: Bearer {TOKEN}".encode()))
    assert status_of(right) == 200
    time.sleep(0.2)  # what the daemon would log about these
    assert TOKEN not in daemon.log.read_bytes()[offset:].decode(errors="replace")
    assert all(event["level"] in ("debug", "info") for event in log_since(daemon, offset))


EMIT_TRACEBACK = """
import sys
from hetspec.logs import configure_logging, get_logger
configure_logging("info", sys.argv[1])
def authorize(token):
    secret_local = token
    raise ValueError("boom")
try:
    authorize("%s")
except ValueError:
    get_logger("hetspec.test").exception("unhandled error")
"""


@pytest.mark.parametrize("log_format", ["json", "console"])
def test_tracebacks_name_no_local_variables(log_format: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", EMIT_TRACEBACK % TOKEN, log_format],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "ValueError" in result.stderr
    assert "authorize" in result.stderr  # the frames are there, their variables are not
    assert TOKEN not in result.stderr
    assert "secret_local" not in result.stderr


def test_the_help_warns_that_the_command_line_is_visible_and_names_the_token_file() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "tcp.token_file" in text
    assert "(ps)" in text


def test_a_token_file_others_can_read_is_refused(tmp_path) -> None:
    config = tmp_path / "hetspecd.toml"
    config.write_text("")
    settings = {"tcp.listen": "127.0.0.1:8080"}
    for mode in (0o644, 0o602):
        path = token_file(tmp_path, mode)
        with pytest.raises(ConfigError, match=r"every user \(mode 0\d\d\d\)"):
            load_config(config, {**settings, "tcp.token_file": str(path)}, environ={})
    for mode in (0o600, 0o640):
        path = token_file(tmp_path, mode)
        loaded = load_config(config, {**settings, "tcp.token_file": str(path)}, environ={})
        assert loaded.tcp.token == TOKEN


# ----------------------------------------------------------------- 10: malformed requests

MALFORMED = [
    b"GET /health HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /api/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n",
]


def test_malformed_requests_are_answered_400_and_leave_no_error_in_the_log(daemon) -> None:
    offset = daemon.log.stat().st_size
    for _ in range(5):
        for raw in MALFORMED:
            answer = exchange(unix(daemon), raw)
            assert not answer or status_of(answer) == 400, answer
    assert status_of(exchange(unix(daemon), get("/health"))) == 200
    time.sleep(0.2)
    events = log_since(daemon, offset)
    assert not [e for e in events if e["level"] not in ("debug", "info") or "exception" in e]


def post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return b"\r\n".join(
        [
            f"POST {path} HTTP/1.1".encode(),
            b"Host: hetspecd",
            b"Connection: close",
            b"Content-Type: application/json",
            f"Content-Length: {len(data)}".encode(),
            b"",
            data,
        ]
    )


@pytest.mark.parametrize("temperature", [1e308, 1e-300, 100.5, -1.0])
def test_a_temperature_out_of_range_is_400_with_the_range_and_nothing_in_the_log(
    daemon, temperature: float
) -> None:
    """1e308 once reached numpy, whose overflow warning landed in the JSON log as raw text."""
    offset = daemon.log.stat().st_size
    requests = {
        "/api/generate": {"prompt": "x", "options": {"temperature": temperature}},
        "/v1/completions": {"prompt": "x", "temperature": temperature, "max_tokens": 2},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": "x"}],
            "temperature": temperature,
            "max_tokens": 2,
        },
    }
    for path, body in requests.items():
        answer = exchange(unix(daemon), post(path, body))
        assert status_of(answer) == 400, (path, answer)
        assert b"temperature must be 0 (greedy) or in 0.001..100.0" in answer, answer
    ok = exchange(
        unix(daemon),
        post("/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 100.0, "seed": 1}),
    )
    assert status_of(ok) == 200, ok
    time.sleep(0.2)
    text = daemon.log.read_bytes()[offset:].decode()
    assert all(line.startswith("{") for line in text.splitlines() if line), text
    assert not [e for e in log_since(daemon, offset) if e["level"] not in ("debug", "info")]


def test_a_prompt_that_cannot_fit_is_refused_before_anything_tokenizes_it(daemon) -> None:
    """100,000 empty chat messages (3.3 MB, under the body limit) once kept the verifier's
    worker tokenizing for ~90 s, and every request behind it waited: now they, a prompt of
    more bytes than the context's tokens could hold, and one of more control tokens than it
    has tokens, are 400 at once, and a request sent right
    after is served at once."""
    chat = {"messages": [{"role": "user", "content": ""}] * 100_000, "max_tokens": 1}
    started = time.monotonic()
    answer = exchange(unix(daemon), post("/v1/chat/completions", chat))
    assert status_of(answer) == 400, answer[:300]
    assert b"100,000 messages cannot fit the" in answer
    ollama = {"model": "x", "messages": chat["messages"], "stream": False}
    assert status_of(exchange(unix(daemon), post("/api/chat", ollama))) == 400
    huge = {"prompt": "<|im_start|>" * 270_000, "max_tokens": 1}
    answer = exchange(unix(daemon), post("/v1/completions", huge))
    assert status_of(answer) == 400, answer[:300]
    assert b"which cannot fit the" in answer
    # under the bytes bound, but more control tokens than the context has tokens (llama.cpp
    # takes time quadratic in their count: 40,000 kept SmolLM2's worker busy 5 s)
    dense = {"prompt": "<|im_end|>" * (CONTEXT + 1), "max_tokens": 1}
    answer = exchange(unix(daemon), post("/v1/completions", dense))
    assert status_of(answer) == 400, answer[:300]
    assert f"at least {CONTEXT + 1:,} tokens".encode() in answer
    assert time.monotonic() - started < 10
    small = {"prompt": "x", "max_tokens": 2}
    started = time.monotonic()
    assert status_of(exchange(unix(daemon), post("/v1/completions", small))) == 200
    assert time.monotonic() - started < 1


def test_clients_that_reset_mid_stream_are_debug_lines_not_errors(daemon) -> None:
    """A client gone mid-stream (a reset, not a close) once surfaced as an unhandled
    ClientConnectionResetError with a traceback at ERROR, now and then."""
    import struct  # noqa: PLC0415

    offset = daemon.log.stat().st_size
    body = {
        "prompt": "class A:\n",
        "stream": True,
        "options": {"num_predict": 3500},
        "ignore_eos": True,
    }
    for index in range(12):
        over_tcp = index % 3 == 0  # TCP resets for real; a Unix socket reports a broken pipe
        connection = tcp(daemon) if over_tcp else unix(daemon)
        raw = post("/api/generate", body)
        if over_tcp:
            raw = raw.replace(
                b"Host: hetspecd", f"Host: x\r\nAuthorization: Bearer {TOKEN}".encode()
            )
        connection.sendall(raw)
        connection.recv(4096 if index % 2 else 64)  # the headers, perhaps a piece
        time.sleep(0.01 * (index % 4))
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        connection.close()  # unread data and linger 0: the server's next write is reset
    assert status_of(exchange(unix(daemon), get("/health"))) == 200
    time.sleep(0.5)
    events = log_since(daemon, offset)
    assert not [e for e in events if e["level"] not in ("debug", "info") or "exception" in e]


def record(message: object, level: int = logging.ERROR, name: str = "aiohttp.server"):
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_the_rate_limit_lets_a_burst_through_then_one_notice_then_counts() -> None:
    now = [0.0]
    limit = RateLimit(burst=3, interval_s=30, clock=lambda: now[0])
    passed = [limit.filter(record("Error handling request from %s")) for _ in range(10)]
    assert passed == [True] * 4 + [False] * 6
    assert limit.filter(record("another event"))  # a bucket per event
    assert limit.filter(record("Error handling request from %s", logging.INFO))
    structlog_event = {"event": "worker lost", "worker": "cpu"}
    for _ in range(3):
        assert limit.filter(record(structlog_event, logging.WARNING, "hetspec.daemon"))
    notice = record(structlog_event, logging.WARNING, "hetspec.daemon")
    assert limit.filter(notice)
    assert "rate_limited" in notice.msg
    now[0] += 10  # one token back for each event (3 per 30 s)
    again = record("Error handling request from %s")
    again.args = ("a client",)
    assert limit.filter(again)
    assert again.getMessage() == "Error handling request from a client (suppressed=6)"
    assert not limit.filter(record("Error handling request from %s"))


EMIT_FLOOD = """
import logging
from hetspec.logs import configure_logging, get_logger
configure_logging("info", "json")
for index in range(500):
    get_logger("hetspec.test").error("bad thing", index=index)
    logging.getLogger("aiohttp.server").error("Error handling request from %s", index)
"""


def test_a_flood_of_errors_is_a_few_lines() -> None:
    result = subprocess.run(
        [sys.executable, "-c", EMIT_FLOOD], capture_output=True, text=True, timeout=60, check=True
    )
    events = [json.loads(line) for line in result.stderr.splitlines()]
    assert 2 * 11 <= len(events) <= 2 * 12  # per event: the burst (10), the notice, a refill
    assert sum("rate_limited" in json.dumps(event) for event in events) == 2


# ----------------------------------------------------------------- 11: cancelled generations


def generations(daemon) -> dict[str, float]:
    text = exchange(unix(daemon), get("/metrics")).decode()
    found = re.findall(r'hetspec_generations_total\{mode="[^"]+",reason="([^"]+)"\} (\S+)', text)
    return {reason: float(count) for reason, count in found}


def test_a_generation_the_client_leaves_is_counted_as_cancelled(daemon) -> None:
    before = generations(daemon)
    connection, response = stream(
        daemon.socket, native("class A:\n", max_tokens=4000, ignore_eos=True)
    )
    assert json.loads(response.readline())["done"] is False
    connection.close()
    response.close()
    deadline = time.monotonic() + 30
    while generations(daemon).get("cancelled", 0) == before.get("cancelled", 0):
        assert time.monotonic() < deadline, generations(daemon)
        time.sleep(0.1)
    after = generations(daemon)
    assert after["cancelled"] == before.get("cancelled", 0) + 1
    assert after.get("length", 0) == before.get("length", 0)


# ----------------------------------------------------------------- connections


def test_an_idle_or_slow_connection_is_closed_after_the_idle_timeout(daemon) -> None:
    for partial in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"):  # idle, headers unfinished
        connection = unix(daemon)
        connection.settimeout(IDLE_TIMEOUT_S + 10)
        started = time.monotonic()
        with connection:
            connection.sendall(partial)
            assert read_all(connection) == b""
        assert IDLE_TIMEOUT_S - 0.5 < time.monotonic() - started < IDLE_TIMEOUT_S + 10


def health_status(daemon) -> int | None:
    """/health's status, None where the connection was refused after the request was sent
    (closed unread: a reset rather than the 503)."""
    try:
        return status_of(exchange(unix(daemon), get("/health")))
    except ConnectionResetError:
        return None


def test_connections_over_the_limit_are_answered_503_and_closed(daemon) -> None:
    keep_alive = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):  # a request each: surely counted, then idle
            connection = unix(daemon)
            held.append(connection)
            connection.sendall(keep_alive)
            assert status_of(connection.recv(65536)) == 200
        for connect in (unix, tcp):
            refused = read_all(connect(daemon))  # sent before any request, then closed
            assert status_of(refused) == 503
            assert b"too many open connections" in refused
        held.pop().close()
        deadline = time.monotonic() + 10
        while (status := health_status(daemon)) != 200:  # until the server has seen the close
            assert status in (503, None)
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for connection in held:
            connection.close()
    time.sleep(0.2)
    metrics = exchange(unix(daemon), get("/metrics")).decode()
    refused = re.search(r"^hetspec_http_connections_refused_total (\S+)$", metrics, re.M)
    assert refused is not None
    assert float(refused.group(1)) >= 2


def test_the_unit_leaves_room_above_the_connection_limit() -> None:
    limit = int(unit_settings(UNITS / "hetspecd.service")["LimitNOFILE"][0])
    assert limit >= 4 * DaemonConfig().http_max_connections


def test_a_connection_limit_the_descriptor_limit_cannot_hold_is_named() -> None:
    default = DaemonConfig().http_max_connections
    assert descriptor_shortfall(default, 1024) is None  # the usual soft limit holds the default
    problem = descriptor_shortfall(4096, 1024)
    assert problem is not None
    assert f"keep it below {1024 - RESERVED_FDS}" in problem

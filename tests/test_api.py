"""The HTTP API as people and programs reach it: the real daemon on the bundled models, over
its real socket, driven by the client library, the shell client (a subprocess), plain httpx
(an OpenAI-style request) and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_daemon import native
from test_lossless import BundledDaemon

from hetspec.client import AsyncClient, BadRequest, Client, DaemonUnreachable
from hetspec.daemon.api.ollama import ChatBody, GenerateBody, Options
from hetspec.daemon.api.openai import ChatRequest, CompletionRequest
from hetspec.daemon.decode.requests import GenerateRequest

pytestmark = pytest.mark.process

TOKEN = "test-token-0123456789abcdef"
QUEUE = 8
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPT = "def read_lines(path):\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    daemon = BundledDaemon(
        tmp_path_factory.mktemp("api"),
        "draft-cpu",
        "--set",
        f"max_queue={QUEUE}",
        # the queue's tests here need one request decoding while the others wait
        # (several at once: test_parallel_requests)
        "--set",
        "max_parallel=1",
        "--set",
        f'tcp.listen="127.0.0.1:{port}"',
        "--set",
        f'tcp.token="{TOKEN}"',
    )
    daemon.port = port
    yield daemon
    daemon.stop()


@pytest.fixture
def http(daemon):
    with httpx.Client(
        transport=httpx.HTTPTransport(uds=str(daemon.socket)),
        base_url="http://hetspecd",
        timeout=60,
    ) as http:
        yield http


def shell(daemon, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetspec.client.cli", "--host", f"unix://{daemon.socket}", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_client_library_generates_streams_and_chats(daemon) -> None:
    with Client(f"unix://{daemon.socket}") as client:
        assert client.health()["status"] == "ready"
        whole = client.generate(PROMPT, **GREEDY)
        assert len(whole.tokens) == 12
        assert whole.done_reason == "length"
        assert whole.timings["predicted_n"] == 12
        assert whole.speculative["rounds"] >= 1
        with client.stream(PROMPT, **GREEDY) as answer:
            pieces = list(answer)
        assert "".join(pieces) == whole.text
        assert len(pieces) > 1
        assert answer.completion.tokens == whole.tokens
        chat = client.chat([{"role": "user", "content": "Write a function."}], max_tokens=8)
        assert chat.done_reason in ("stop", "length")
        assert chat.timings["predicted_n"] <= 8
        # a chat answer carries the tokens and the devices, as a generation does
        assert len(chat.tokens) == chat.timings["predicted_n"]
        # the drafter on the CPU, in llama.cpp ("cpu") or the native kernels ("cpu (native,
        # avx2)"), whichever measured faster at load
        assert chat.devices["target"] == "cpu"
        assert chat.devices["draft"].startswith("cpu")
        with client.chat_stream([{"role": "user", "content": "Hi"}], max_tokens=8) as answer:
            text = "".join(answer)
        assert answer.completion.text == text
        assert len(answer.completion.tokens) == answer.completion.timings["predicted_n"]
        assert answer.completion.devices == chat.devices
        assert client.models() == ["hetspec-demo"]
        props = client.props()
        assert props["placement"] == "draft-cpu"
        assert props["queue"]["capacity"] == QUEUE
        assert props["gamma"]["adaptive"]["gamma"] >= 0
        with pytest.raises(BadRequest, match="top_p must be in"):
            client.generate(PROMPT, top_p=2)

    async def asynchronous():
        async with AsyncClient(f"unix://{daemon.socket}") as client:
            completion = await client.generate(PROMPT, **GREEDY)
            pieces = [piece async for piece in await client.stream(PROMPT, **GREEDY)]
            return completion, pieces

    completion, pieces = asyncio.run(asynchronous())
    assert completion.tokens == whole.tokens
    assert "".join(pieces) == whole.text

    # a private socket: the hint names it, not the systemd unit
    hint = r"is hetspecd running with `--socket .*missing`"
    with pytest.raises(DaemonUnreachable, match=hint) as no:
        Client(f"unix://{daemon.socket}.missing").health()
    assert "systemctl" not in str(no.value)


def test_sampled_text_never_shows_control_tokens(daemon) -> None:
    """The bundled models sometimes draw <|im_start|>, <|im_end|> or <|endoftext|> (ids 0-2)
    when sampling hot: the tokens are returned, the text never shows them, in the target
    alone and in speculative rounds."""
    drawn = 0
    with Client(f"unix://{daemon.socket}") as client:
        for seed in range(30):
            for mode in ("autoregressive", "adaptive"):
                done = client.generate(
                    "def main():",
                    max_tokens=96,
                    temperature=1.3,
                    seed=seed,
                    ignore_eos=True,
                    mode=mode,
                )
                drawn += any(token in (0, 1, 2) for token in done.tokens)
                assert "<|" not in done.text, (seed, mode, done.text)
    assert drawn >= 3  # the check saw control tokens drawn


def test_openai_requests_with_plain_httpx(daemon, http) -> None:
    alone = http.post("/api/generate", json=native(PROMPT, **GREEDY)).json()
    body = {"model": "anything", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    completion = http.post("/v1/completions", json=body).json()
    assert completion["object"] == "text_completion"
    assert completion["model"] == "hetspec-demo"
    # greedy, so the same text as the native API (unless EOS came early)
    assert alone["response"].startswith(completion["choices"][0]["text"])
    assert completion["usage"]["completion_tokens"] == completion["timings"]["predicted_n"]

    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert (
        "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        == (completion["choices"][0]["text"])
    )
    assert chunks[-1]["usage"]["total_tokens"] > chunks[-1]["usage"]["completion_tokens"]

    chat = {
        "messages": [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def add(a, b):"},
        ],
        "max_tokens": 10,
        "stream": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=chat) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == "hetspec-demo"
    assert http.get("/v1/models/hetspec-demo").json() == models["data"][0]
    missing = http.get("/v1/models/gpt-4")
    assert missing.status_code == 404
    assert "'gpt-4'" in missing.json()["error"]["message"]
    assert "'hetspec-demo'" in missing.json()["error"]["message"]

    # seeded sampling: the same text on both endpoints (the target's keyed choices)
    sampled = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": 9}
    alone = http.post("/api/generate", json=native(**sampled)).json()
    completion = http.post("/v1/completions", json=sampled).json()
    assert completion["choices"][0]["text"] == alone["response"]


def test_chat_content_as_text_parts_and_neutral_openai_values(http) -> None:
    """Content given as a list of text parts reads as the parts joined; OpenAI's neutral
    response_format and store are accepted, other values and non-text parts are a 400 that
    names them."""
    greedy = {"max_tokens": 10, "temperature": 0}
    whole = [{"role": "user", "content": "Write a function that adds two numbers."}]
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Write a function "},
                {"type": "text", "text": "that adds two numbers."},
            ],
        }
    ]
    answers = [
        http.post(
            "/v1/chat/completions",
            json={
                "messages": messages,
                **greedy,
                "response_format": {"type": "text"},
                "store": False,
            },
        ).json()
        for messages in (whole, parts)
    ]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert answers[0]["usage"] == answers[1]["usage"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for body, named in (
        ({"messages": image}, "'image_url'"),
        ({"messages": whole, "response_format": {"type": "yaml"}}, "'yaml'"),
        ({"messages": whole, "store": True}, "store"),
    ):
        refused = http.post("/v1/chat/completions", json={**body, **greedy})
        assert refused.status_code == 400, body
        assert named in refused.json()["error"]["message"]


def test_several_answers_n_and_prompt_lists_streamed_or_not(http) -> None:
    """n answers per prompt and a list of prompts: choices in order (prompt by prompt, n
    each), the j-th answer drawn with seed + j, usage over all of them; streamed, every
    chunk names its choice and the usage chunk lists each answer's extras."""
    sampled = {"max_tokens": 8, "temperature": 0.8, "seed": 40}
    prompts = [PROMPT, "class Stack:"]
    both = http.post("/v1/completions", json={"prompt": prompts, "n": 2, **sampled}).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    for index, choice in enumerate(both["choices"]):
        prompt, answer = prompts[index // 2], index % 2
        alone = http.post(
            "/api/generate", json=native(prompt, **{**sampled, "seed": 40 + answer})
        ).json()
        assert choice["text"] == alone["response"], index
        assert choice["tokens"] == alone["tokens"]  # the extras, per choice
    usage = both["usage"]
    assert usage["prompt_tokens"] == sum(
        both["choices"][2 * i]["timings"]["prompt_n"] for i in range(2)
    )  # each prompt once
    assert usage["completion_tokens"] == sum(len(c["tokens"]) for c in both["choices"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    body = {
        "prompt": prompts,
        "n": 2,
        **sampled,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    texts = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in both["choices"]}
    assert chunks[-1]["usage"] == usage
    assert [a["tokens"] for a in chunks[-1]["answers"]] == [c["tokens"] for c in both["choices"]]

    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, **sampled}
    answers = http.post("/v1/chat/completions", json=chat).json()["choices"]
    assert [c["message"]["role"] for c in answers] == ["assistant", "assistant"]
    too_many = http.post("/v1/completions", json={"prompt": prompts, "n": 9, **sampled})
    assert too_many.status_code == 400
    assert "18" in too_many.json()["error"]["message"]


def test_native_ndjson_stream_over_raw_http(daemon) -> None:
    payload = json.dumps({**native(PROMPT, **GREEDY), "stream": True}).encode()
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(daemon.socket))
        raw.sendall(
            b"POST /api/generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )
        data = b""
        while chunk := raw.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"application/x-ndjson" in head
    assert b"chunked" in head.lower()
    lines = []
    while body:  # de-chunk
        size, _, rest = body.partition(b"\r\n")
        size = int(size, 16)
        lines.append(rest[:size])
        body = rest[size + 2 :]
    objects = [json.loads(line) for line in b"".join(lines).splitlines()]
    final = objects[-1]
    assert final["done"] is True
    assert final["done_reason"] == "length"
    assert len(final["tokens"]) == 12
    assert {
        "prompt_n",
        "prompt_ms",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "draft_n",
        "draft_n_accepted",
        "ttft_ms",
    } <= set(final["timings"])
    assert {"mean_accepted_length", "acceptance_by_depth", "gamma_history"} <= set(
        final["speculative"]
    )
    assert all(not o["done"] for o in objects[:-1])
    assert len(objects) > 2


def test_the_shell_client(daemon) -> None:
    run = shell(daemon, "run", PROMPT, "--max-tokens", "12")
    assert run.returncode == 0, run.stderr
    assert "tokens/s" in run.stderr
    assert "accepted per round" in run.stderr
    as_json = shell(daemon, "--json", "run", PROMPT, "--max-tokens", "12")
    document = json.loads(as_json.stdout)
    assert run.stdout.rstrip("\n") == document["response"]
    status = shell(daemon, "--json", "status")
    assert json.loads(status.stdout)["placement"] == "draft-cpu"
    human = shell(daemon, "status")
    assert human.returncode == 0
    assert "live gamma" in human.stdout
    chat = shell(daemon, "chat", "--max-tokens", "6", stdin="hello\nand again\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stderr.count("tokens/s") == 2
    seeded = [
        shell(
            daemon,
            "run",
            PROMPT,
            "--max-tokens",
            "30",
            "--temperature",
            "0.8",
            "--seed",
            "1",
            "--mode",
            mode,
        ).stdout
        for mode in ("adaptive", "sequential", "autoregressive")
    ]
    assert seeded[0] == seeded[1] == seeded[2] != ""
    bad = shell(daemon, "run", PROMPT, "--top-p", "7")
    assert bad.returncode == 1
    assert "top_p must be in (0, 1]" in bad.stderr
    for option, value in (("--temperature", "nan"), ("--top-p", "inf")):
        bad = shell(daemon, "run", PROMPT, option, value)
        assert bad.returncode == 2
        assert f"{option}: must be a finite number, not '{value}'" in bad.stderr
        assert "Traceback" not in bad.stderr
    piped = shell(daemon, "run", "-", "--max-tokens", "12", stdin=PROMPT)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == run.stdout
    wrong = subprocess.run(
        [sys.executable, "-m", "hetspec.client.cli", "--host", "ftp://x", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "HETSPEC_HOST": ""},
    )
    assert wrong.returncode == 2
    assert "the host must be unix:///path or http://host:port, not 'ftp://x'" in wrong.stderr
    gone = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetspec.client.cli",
            "--host",
            "unix:///nonexistent/hetspecd.sock",
            "status",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert gone.returncode == 1
    assert "cannot reach hetspecd" in gone.stderr
    assert "Traceback" not in gone.stderr
    gone_json = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetspec.client.cli",
            "--json",
            "--host",
            "unix:///nonexistent/hetspecd.sock",
            "status",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert gone_json.returncode == 1
    assert "cannot reach hetspecd" in json.loads(gone_json.stdout)["error"]
    turns = shell(daemon, "--json", "chat", "--max-tokens", "6", stdin="hello\nand again\n")
    documents = [json.loads(line) for line in turns.stdout.splitlines()]  # one line per turn
    assert len(documents) == 2
    assert all(d["tokens"] and d["devices"] for d in documents)


def test_metrics_count_what_was_served(daemon, http) -> None:
    http.post("/api/generate", json=native(PROMPT, **GREEDY))
    text = http.get("/metrics").text
    for name in (
        "hetspec_http_requests_total",
        "hetspec_generated_tokens_total",
        "hetspec_time_to_first_token_seconds_bucket",
        "hetspec_draft_tokens_total",
        'hetspec_rounds_accepted_at_depth_total{depth="1"}',
        'hetspec_worker_restarts{worker="cpu"}',
        "hetspec_decode_tokens_per_second",
    ):
        assert name in text, name


def test_tcp_needs_the_bearer_token(daemon) -> None:
    url = f"http://127.0.0.1:{daemon.port}"
    assert httpx.get(f"{url}/health").status_code == 401
    wrong = httpx.get(f"{url}/health", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert "bearer token" in wrong.json()["error"]["message"]
    with Client(url, token=TOKEN) as client:
        assert client.generate(PROMPT, **GREEDY).timings["predicted_n"] == 12


def test_twenty_clients_at_once_fifo_or_429(daemon) -> None:
    """Sent 15 ms apart: those admitted finish in the order they were sent, the others are
    refused with 429 and a Retry-After; nothing is lost."""

    async def one(client: httpx.AsyncClient, index: int):
        await asyncio.sleep(index * 0.015)
        body = native(f"def f{index}(x):\n", max_tokens=48, ignore_eos=True, temperature=0)
        response = await client.post("/api/generate", json=body)
        return index, response.status_code, time.monotonic(), response

    async def burst():
        transport = httpx.AsyncHTTPTransport(uds=str(daemon.socket))
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://x", timeout=120, limits=limits
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(20)))

    results = asyncio.run(burst())
    assert {status for _, status, _, _ in results} <= {200, 429}
    served = [r for r in results if r[1] == 200]
    refused = [r for r in results if r[1] == 429]
    assert len(served) + len(refused) == 20
    assert refused, "the queue never filled"
    assert len(served) >= QUEUE + 1
    for _, _, _, response in refused:
        assert int(response.headers["Retry-After"]) >= 1
        assert "queue" in response.json()["error"]  # Ollama's shape: the message
    finish_order = [index for index, *_ in sorted(served, key=lambda r: r[2])]
    assert finish_order == sorted(finish_order), finish_order
    for _, _, _, response in served:
        assert len(response.json()["tokens"]) == 48
    ids = [int(r[3].json()["id"].split("-")[1]) for r in sorted(served)]
    assert ids == sorted(ids)


# ---------------------------------------------------------------- fuzzing: bad input is a 4xx

VALID = {
    "/api/generate": {
        "prompt": "def f(x):",
        "raw": True,
        "options": {"num_predict": 4},
        "stream": False,
    },
    "/api/chat": {
        "messages": [{"role": "user", "content": "hi"}],
        "options": {"num_predict": 4},
        "stream": False,
    },
    "/v1/completions": {"prompt": "def f(x):", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}
NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.booleans())
JUNK = st.one_of(
    st.none(),
    NUMBERS,
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
OUT_OF_RANGE = {  # each value is wrong for its field on every endpoint that has the field
    # (Ollama's num_predict takes -1 and -2: to the end of the context; completions take 0:
    # the prompt's log-probabilities alone, with echo)
    "max_tokens": st.one_of(st.integers(max_value=-3), st.integers(min_value=1_000_001)),
    "temperature": st.one_of(st.floats(max_value=-1e-9, allow_nan=False), st.just(1e400)),
    "top_p": st.one_of(st.floats(max_value=0, allow_nan=False), st.floats(min_value=1.001)),
    "top_k": st.integers(max_value=-1),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63)),
    "gamma": st.one_of(st.integers(max_value=0), st.integers(min_value=33)),
    "mode": st.text(max_size=12).filter(
        lambda m: m not in ("autoregressive", "sequential", "parallel", "adaptive")
    ),
    "stop": st.lists(st.just("x"), min_size=17, max_size=20),
    "n": st.one_of(st.integers(max_value=0), st.integers(min_value=17, max_value=2**40)),
}


def _raw(document) -> bytes:
    return json.dumps(document).encode()


OLLAMA_OPTIONS = {
    "max_tokens": "num_predict",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
}


def _set(body: dict, field: str, value) -> dict:
    """``body`` with ``field`` set: in Ollama's ``options`` where the body has them."""
    if "options" in body and field in OLLAMA_OPTIONS:
        return {**body, "options": {**body["options"], OLLAMA_OPTIONS[field]: value}}
    return {**body, field: value}


def _text_field(body: dict) -> str:
    return "prompt" if "prompt" in body else "messages"


def _with_text(body: dict, text: str) -> dict:
    if "prompt" in body:
        return {**body, "prompt": text}
    return {**body, "messages": [{"role": "user", "content": text}]}


def _garbage_bytes(draw, body):
    return draw(st.binary(max_size=64).filter(lambda b: not _is_json_object(b)))


def _not_an_object(draw, body):
    return _raw(draw(st.one_of(NUMBERS, st.text(), st.lists(st.integers()))))


def _wrong_type(draw, body):
    field = draw(st.sampled_from(["max_tokens", "temperature", "stream", "top_k", "seed"]))
    # Ollama's options take null for "the default"
    ollama = "options" in body and field in OLLAMA_OPTIONS
    junk = JUNK.filter(lambda v: not _fits(field, v) and not (ollama and v is None))
    return _raw(_set(body, field, draw(junk)))


def _unknown_field(draw, body):
    name = draw(st.text(min_size=1, max_size=10).filter(lambda n: n not in _FIELDS))
    return _raw({**body, name: draw(JUNK)})


def _out_of_range(draw, body):
    field = draw(st.sampled_from(sorted(OUT_OF_RANGE)))
    return _raw(_set(body, field, draw(OUT_OF_RANGE[field])))


def _missing(draw, body):
    return _raw({k: v for k, v in body.items() if k != _text_field(body)})


def _bad_utf8(draw, body):
    text = b'"\xff\xfe' + draw(st.binary(max_size=4)) + b'"'
    return _raw(_with_text(body, "@@")).replace(b'"@@"', text)


def _surrogate(draw, body):
    return _raw(_with_text(body, "@@")).replace(
        b"@@", draw(st.sampled_from([b"\\ud800", b"\\udfff"]))
    )


def _nan(draw, body):
    value = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity"]))
    return _raw(body)[:-1] + b', "temperature": ' + value + b"}"


def _too_long(draw, body):  # a prompt longer than the context
    return _raw(_with_text(body, "x = 1\n" * 3000))


def _empty(draw, body):
    if "prompt" in body:
        return _raw({**body, "prompt": ""})
    return _raw(
        {**body, "messages": draw(st.sampled_from([[], [{"role": "wizard", "content": "x"}]]))}
    )


MUTATIONS = [
    _garbage_bytes,
    _not_an_object,
    _wrong_type,
    _unknown_field,
    _out_of_range,
    _missing,
    _bad_utf8,
    _surrogate,
    _nan,
    _too_long,
    _empty,
]
# Ollama's /api/generate without a prompt only loads the model: a valid request
VALID_WITHOUT_TEXT = {"/api/generate"}


@st.composite
def bad_requests(draw) -> tuple[str, str, bytes]:
    """(method, path, body) that the API must refuse with a 4xx."""
    path = draw(st.sampled_from(sorted(VALID)))
    body = dict(VALID[path])
    kind = draw(st.integers(0, len(MUTATIONS) + 1))
    while (
        kind < len(MUTATIONS)
        and MUTATIONS[kind] in (_missing, _empty)
        and (path in VALID_WITHOUT_TEXT)
    ):
        kind = draw(st.integers(0, len(MUTATIONS) + 1))
    if kind == len(MUTATIONS):
        return draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"])), path, b""
    if kind == len(MUTATIONS) + 1:
        return "POST", "/" + draw(st.text(alphabet="abcxyz", max_size=12)), _raw(body)
    return "POST", path, MUTATIONS[kind](draw, body)


_FIELDS = {
    *GenerateRequest.__struct_fields__,
    *CompletionRequest.__struct_fields__,
    *ChatRequest.__struct_fields__,
    *GenerateBody.__struct_fields__,
    *ChatBody.__struct_fields__,
    *Options.__struct_fields__,
}


def _fits(field: str, value) -> bool:
    """Would ``value`` be a valid value of ``field``? (Then it is no wrong-type mutation.)"""
    if field == "stream":
        return isinstance(value, bool)
    if field == "temperature":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    if field == "seed":
        return value is None or (type(value) is int and 0 <= value < 2**63)
    if field == "top_k":
        return type(value) is int and value >= 0
    return (type(value) is int and (1 <= value <= 1_000_000 or value in (-1, -2))) or (
        value is None and field == "max_tokens"
    )


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


def test_fuzzed_bad_requests_are_all_4xx_and_the_daemon_keeps_serving(daemon, http) -> None:
    answered = []

    @settings(
        max_examples=600,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(bad_requests())
    def send(case) -> None:
        method, path, raw = case
        response = http.request(
            method, path, content=raw, headers={"Content-Type": "application/json"}
        )
        assert 400 <= response.status_code < 500, (case, response.status_code, response.text)
        error = response.json()["error"]  # Ollama's shape under /api/: the message alone
        assert error if isinstance(error, str) else error["message"], case
        answered.append(response.status_code)

    send()
    assert len(answered) >= 500
    assert daemon.process.poll() is None
    assert http.get("/health").status_code == 200
    served = http.post("/api/generate", json=native(PROMPT, **GREEDY))
    assert served.status_code == 200
    assert len(served.json()["tokens"]) == 12


def test_a_client_that_leaves_the_queue_is_forgotten(daemon, http) -> None:
    """A queued request whose client disconnects leaves the queue at once; the running one
    and the next ones are unaffected."""
    import threading  # noqa: PLC0415

    long = native(PROMPT, max_tokens=600, ignore_eos=True)
    results = {}

    def run_long() -> None:
        with httpx.Client(
            transport=httpx.HTTPTransport(uds=str(daemon.socket)), base_url="http://x", timeout=120
        ) as client:
            results["long"] = client.post("/api/generate", json=long)

    runner = threading.Thread(target=run_long)
    runner.start()
    deadline = time.monotonic() + 10
    while not http.get("/props").json()["queue"]["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(httpx.ReadTimeout):  # queued behind the long one, then gone
        http.post("/api/generate", json=native(PROMPT, **GREEDY), timeout=0.3)
    queue = http.get("/props").json()["queue"]
    while queue["waiting"] and time.monotonic() < deadline:
        queue = http.get("/props").json()["queue"]
    assert queue["waiting"] == 0
    assert queue["running"]  # it left while the long request was still decoding
    runner.join()
    assert results["long"].status_code == 200
    assert len(results["long"].json()["tokens"]) == 600
    after = http.post("/api/generate", json=native(PROMPT, **GREEDY))
    assert after.status_code == 200

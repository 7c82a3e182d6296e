"""Echo and the prompt's log-probabilities on ``/v1/completions``, the tokenizer endpoints,
and the leniency front ends expect (ignored OpenAI fields, Ollama's ``num_ctx``, embeddings
refused with what to run instead, the shell client's flags and chat commands), against a real
hetspecd on the bundled pair in its default configuration (every runtime left to choose)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
import transformers
from test_daemon import clean_env

from hetspec.client.daemon_process import DaemonProcess
from hetspec.daemon.config import BUNDLED_MODELS

pytestmark = pytest.mark.process

PROMPT = "def read_lines(path):\n    with open(path) as f:\n"
# The default configuration verifies with the target's q8_0 GGUF, transformers reads the f16
# folder: quantization alone moves a log-probability by up to ~0.04 (test_prompt_logprobs holds
# each runtime to 1e-3 on the same weights)
QUANTIZED = 0.06


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    daemon = DaemonProcess(tmp_path_factory.mktemp("echo"), env=clean_env())
    try:
        daemon.wait_ready(180)
        yield daemon
    finally:
        assert daemon.stop() == 0


@pytest.fixture(scope="module")
def http(daemon):
    transport = httpx.HTTPTransport(uds=str(daemon.socket))
    with httpx.Client(transport=transport, base_url="http://hetspecd", timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def reference():
    """The target's log-probabilities of every token after the first, through transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        BUNDLED_MODELS / "target", dtype=torch.float32
    )

    def logprobs(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0]
        rows = torch.log_softmax(logits.float(), -1)[:-1]
        return rows.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()

    return logprobs


def _tokens(http, text: str) -> list[int]:
    reply = http.post("/tokenize", json={"content": text, "add_special": False})
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


@pytest.mark.parametrize("max_tokens", [0, 1, 5])
def test_echo_reports_the_prompt_tokens_as_the_target_scores_them(
    http, reference, max_tokens
) -> None:
    ids = _tokens(http, PROMPT)
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": max_tokens}
    reply = http.post("/v1/completions", json={**body, "temperature": 0})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    logprobs = choice["logprobs"]
    prompt_ids = reply.json()["usage"]["prompt_tokens"]
    assert choice["text"].startswith(PROMPT)
    generated = len(logprobs["tokens"]) - prompt_ids
    assert generated == max_tokens or choice["finish_reason"] == "stop"
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert logprobs["text_offset"][0] == 0
    # the same text's ids (the daemon's own tokenization may add a BOS before them)
    assert "".join(logprobs["tokens"][:prompt_ids]).endswith(PROMPT)
    scored = logprobs["token_logprobs"][prompt_ids - len(ids) + 1 : prompt_ids]
    if prompt_ids == len(ids):
        np.testing.assert_allclose(scored, reference(ids), atol=QUANTIZED)
    for value, top in zip(
        logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True
    ):
        assert value <= max(top.values()) + 1e-6


def test_token_id_prompts_singly_and_batched_as_the_harness_sends_them(http, reference) -> None:
    ids = _tokens(http, PROMPT)
    shorter = ids[: len(ids) // 2]
    body = {"prompt": [ids, shorter], "echo": True, "logprobs": 1, "max_tokens": 1}
    reply = http.post("/v1/completions", json={**body, "temperature": 0})
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice, prompt in zip(choices, [ids, shorter], strict=True):
        scored = choice["logprobs"]["token_logprobs"][1 : len(prompt)]
        np.testing.assert_allclose(scored, reference(prompt), atol=QUANTIZED)
    single = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0})
    assert single.status_code == 200, single.text
    assert single.json()["usage"]["prompt_tokens"] == len(ids)
    # without logprobs echo is the text alone
    plain = http.post(
        "/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0}
    ).json()
    assert plain["choices"][0]["text"] == PROMPT
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": [5, 1 << 20], "echo": True, "logprobs": 0}, "prompt"),
        ({"prompt": [-1], "logprobs": 0}, "prompt"),
        ({"prompt": [3] * 5000, "echo": True, "logprobs": 0, "max_tokens": 0}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": "x", "echo": True, "stream": True}, "echo"),
        ({"prompt": "x", "frequency_penaltyy": 0}, "frequency_penaltyy"),
        ({"prompt": "x", "stream_options": {"include_usagee": True}}, "include_usagee"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, body, named) -> None:
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"]["message"]


def test_harmless_openai_fields_are_accepted_and_ignored(http) -> None:
    base = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    expected = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    lenient = {
        "metadata": {"purpose": "test"},
        "user": "someone",
        "service_tier": "auto",
        "parallel_tool_calls": False,
    }
    reply = http.post("/v1/completions", json={**base, **lenient})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {
            "include_usage": True,
            "continuous_usage_stats": True,
            "include_obfuscation": False,
        },
        **lenient,
    }
    reply = http.post("/v1/chat/completions", json=chat)
    assert reply.status_code == 200, reply.text
    assert reply.text.rstrip().endswith("data: [DONE]")


def test_tokenize_and_detokenize_in_llama_cpp_and_vllm_shapes(http) -> None:
    ids = _tokens(http, PROMPT)
    assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == PROMPT
    vllm = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert vllm["tokens"] == ids
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT
    pieces = http.post("/tokenize", json={"content": PROMPT, "with_pieces": True}).json()
    assert [p["id"] for p in pieces["tokens"]] == ids
    assert "".join(p["piece"] for p in pieces["tokens"]) == PROMPT
    info = http.get("/tokenizer_info").json()
    assert _tokens(http, info["eos_token"]) == [0]  # the bundled target's EOS id
    assert info["model_max_length"] >= 512
    outside = http.post("/detokenize", json={"tokens": [1 << 20]})
    assert outside.status_code == 400
    assert "tokens" in outside.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/api/embed", "/api/embeddings"])
def test_embeddings_are_refused_naming_what_to_run_instead(http, path) -> None:
    reply = http.post(path, json={"model": "x", "input": "hello"})
    assert reply.status_code == 501
    assert "llama-server --embedding" in reply.text


def test_ollama_num_ctx_above_the_context_is_served_at_the_context(http) -> None:
    body = {"prompt": PROMPT, "raw": True, "stream": False, "options": {"num_predict": 4}}
    plain = http.post("/api/generate", json=body).json()
    asked = {**body, "options": {"num_predict": 4, "num_ctx": 1 << 20}}
    reply = http.post("/api/generate", json=asked)
    assert reply.status_code == 200, reply.text
    assert reply.json()["response"] == plain["response"]
    assert (
        reply.json()["served_context"] == http.get("/api/ps").json()["models"][0]["context_length"]
    )
    assert "served_context" not in plain


def _shell(daemon, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetspec.client.cli", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=clean_env(),
    )


def test_the_shell_client_takes_flags_after_the_subcommand_and_chat_has_help(daemon) -> None:
    host = f"unix://{daemon.socket}"
    after = _shell(daemon, "run", "def f(x):", "--max-tokens", "4", "--host", host, "--json")
    assert after.returncode == 0, after.stderr
    assert '"response"' in after.stdout
    before = _shell(daemon, "--host", host, "health")
    assert before.stdout.strip() == "ready"
    chat = _shell(daemon, "chat", "--socket", str(daemon.socket), stdin="/help\n/nope\n/exit\n")
    assert chat.returncode == 0, chat.stderr
    assert "/clear" in chat.stdout
    assert "unknown command /nope" in chat.stdout

"""Clients nobody here wrote, against the real daemon on the bundled models: the ``ollama``
package over the Unix socket (Ollama's API is the native one) and the ``openai`` package over
TCP with the bearer token, every call they make, streamed and not."""

from __future__ import annotations

from datetime import datetime

import numpy as np
import ollama
import openai
import pytest
import torch
from real_daemon import ollama_client, openai_client, socket_http, tcp_daemon

from hetspec import __version__
from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.workers.runtimes.torch_runtime import TorchRuntime

pytestmark = pytest.mark.process

TOKEN = "test-token-real-clients-0123"
PROMPT = "def read_lines(path):\n"
QUESTION = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with tcp_daemon(tmp_path_factory.mktemp("clients"), TOKEN) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def local(daemon):
    with ollama_client(daemon) as client:
        yield client


@pytest.fixture(scope="module")
def http(daemon):
    with socket_http(daemon) as http:
        yield http


@pytest.fixture(scope="module")
def remote(daemon):
    return openai_client(daemon, TOKEN)


def _check_ollama_final(final, text_tokens: int | None = None) -> None:
    assert final.done is True
    assert final.done_reason in ("stop", "length")
    datetime.fromisoformat(final.created_at)
    assert final.eval_count >= 1
    assert final.prompt_eval_count >= 1
    # nanoseconds: a positive duration, the total covering both phases
    assert 0 < final.eval_duration <= final.total_duration
    assert 0 < final.prompt_eval_duration <= final.total_duration
    assert final.load_duration == 0
    if text_tokens is not None:
        assert final.eval_count == text_tokens


# ---------------------------------------------------------------- Ollama


def test_ollama_generate_raw_is_the_native_continuation(local, http) -> None:
    """raw: the prompt continued as given, the same greedy text the native API gave; the
    counts and durations are Ollama's, our statistics ride along on the wire."""
    options = {"num_predict": 12, "temperature": 0}
    answer = local.generate(model="hetspec-demo", prompt=PROMPT, raw=True, options=options)
    body = {"prompt": PROMPT, "raw": True, "options": options, "stream": False}
    wire = http.post("/api/generate", json=body).json()
    assert answer.response == wire["response"]
    _check_ollama_final(answer, len(wire["tokens"]))
    assert wire["timings"]["predicted_n"] == len(wire["tokens"])
    assert wire["speculative"]["rounds"] >= 1
    assert wire["mode"] == "adaptive"

    pieces = list(
        local.generate(model="hetspec-demo", prompt=PROMPT, raw=True, options=options, stream=True)
    )
    assert all(not p.done for p in pieces[:-1])
    assert "".join(p.response for p in pieces) == answer.response
    _check_ollama_final(pieces[-1], answer.eval_count)


def test_ollama_generate_applies_the_chat_template_unless_raw(local, remote) -> None:
    """Without raw the prompt is the user's turn in the model's chat template (a system
    prompt before it): the answer OpenAI's chat endpoint gives the same messages."""
    options = {"num_predict": 10, "temperature": 0}
    templated = local.generate(
        model="x", prompt=QUESTION[0]["content"], system="Be brief.", options=options
    )
    chat = remote.chat.completions.create(
        model="x",
        messages=[{"role": "system", "content": "Be brief."}, *QUESTION],
        max_tokens=10,
        temperature=0,
    )
    assert templated.response == chat.choices[0].message.content
    assert templated.prompt_eval_count == chat.usage.prompt_tokens
    with pytest.raises(ollama.ResponseError, match="system needs the chat template"):
        local.generate(model="x", prompt="x", system="y", raw=True)


def test_ollama_chat_streamed_or_not_and_seeded_like_openai(local, remote) -> None:
    options = {"num_predict": 16, "temperature": 0.8, "seed": 5, "top_p": 0.9}
    whole = local.chat(model="hetspec-demo", messages=QUESTION, options=options)
    assert whole.message.role == "assistant"
    assert whole.message.content
    _check_ollama_final(whole)
    pieces = list(local.chat(model="hetspec-demo", messages=QUESTION, options=options, stream=True))
    assert "".join(p.message.content for p in pieces) == whole.message.content
    assert pieces[-1].done
    assert pieces[-1].message.content == ""
    # the same seed draws the same text on OpenAI's endpoint
    openai_chat = remote.chat.completions.create(
        model="x", messages=QUESTION, max_tokens=16, temperature=0.8, seed=5, top_p=0.9
    )
    assert openai_chat.choices[0].message.content == whole.message.content


def test_ollama_options_stop_top_k_and_neutral_values(local, http) -> None:
    base = local.generate(
        model="x", prompt=PROMPT, raw=True, options={"num_predict": 24, "temperature": 0}
    )
    stop = base.response[8:12]
    stopped = local.generate(
        model="x",
        prompt=PROMPT,
        raw=True,
        options={
            "num_predict": 24,
            "temperature": 0,
            "stop": [stop],
            "repeat_penalty": 1.0,
            "num_ctx": 64,
            "top_k": 1,
            "num_thread": 2,
        },
    )
    assert stopped.response == base.response[: base.response.index(stop)]
    assert stopped.done_reason == "stop"
    # one string where Ollama's clients send a list: the same stop
    body = {
        "prompt": PROMPT,
        "raw": True,
        "stream": False,
        "options": {"num_predict": 24, "temperature": 0, "stop": stop},
    }
    assert http.post("/api/generate", json=body).json()["response"] == stopped.response


@pytest.mark.parametrize(
    ("call", "named"),
    [
        ({"options": {"repeat_penalty": 1.3}}, "options.repeat_penalty"),
        ({"options": {"mirostat": 2}}, "options.mirostat"),
        ({"options": {"num_predict": -5}}, "options.num_predict"),
        ({"options": {"top_p": 0}}, "top_p"),
        ({"keep_alive": 0}, "keep_alive 0"),
        ({"keep_alive": "0s"}, "keep_alive 0"),
        ({"format": {"type": "object", "properties": {"a": {"$ref": "#/no"}}}}, "format"),
        ({"think": True}, "think"),
        ({"suffix": "return x"}, "suffix"),
        ({"images": [b"\x89PNG"]}, "images"),
    ],
)
def test_ollama_refuses_what_it_cannot_honour_naming_it(local, call, named) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        local.generate(model="x", prompt="x", **call)
    assert refused.value.status_code == 400
    assert named in refused.value.error


def test_ollama_chat_refuses_images_and_no_messages(local) -> None:
    # tools are served: tests/test_tool_calls.py
    with pytest.raises(ollama.ResponseError, match="images are not supported"):
        local.chat(model="x", messages=[{**QUESTION[0], "images": [b"\x89PNG"]}])
    with pytest.raises(ollama.ResponseError, match="at least one message"):
        local.chat(model="x", messages=[])


def test_ollama_model_listing_show_ps_version_and_load(local, http) -> None:
    listed = local.list().models
    assert [m.model for m in listed] == ["hetspec-demo"]
    details = listed[0].details
    assert (details.format, details.family) == ("safetensors", "llama")  # torch serves it
    assert details.parameter_size == "5.05M"
    assert details.quantization_level == "F16"
    assert listed[0].size > 1_000_000
    assert len(listed[0].digest) == 64

    shown = local.show("hetspec-demo")
    assert shown.modelinfo["llama.context_length"] == 2048
    assert shown.modelinfo["general.parameter_count"] == 5_048_576
    assert "<|im_start|>" in shown.template
    assert "num_predict 128" in shown.parameters
    assert shown.capabilities == ["completion", "tools"]
    with pytest.raises(ollama.ResponseError) as missing:
        local.show("llama3")
    assert missing.value.status_code == 404
    assert "'hetspec-demo'" in missing.value.error

    running = local.ps().models
    assert running[0].model == "hetspec-demo"
    assert running[0].size_vram == 0
    assert running[0].context_length >= 64
    assert running[0].expires_at.year > 2100  # kept loaded for the daemon's life

    loaded = local.generate(model="hetspec-demo")  # no prompt: Ollama's "load the model"
    assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
    assert http.get("/api/version").json() == {"version": __version__}
    assert http.get("/").text.startswith("hetspecd")  # tools probe it to find the server
    assert http.head("/").status_code == 200


# ---------------------------------------------------------------- OpenAI


def test_openai_completions_streamed_or_not_n_and_prompt_lists(remote) -> None:
    greedy = remote.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0)
    choice = greedy.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.text
    assert greedy.usage.completion_tokens <= 12
    assert greedy.usage.total_tokens == greedy.usage.prompt_tokens + greedy.usage.completion_tokens
    chunks = list(
        remote.completions.create(
            model="x",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == greedy.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason

    several = remote.completions.create(
        model="x", prompt=[PROMPT, "class Stack:"], n=2, max_tokens=6, temperature=0.8, seed=3
    )
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    alone = remote.completions.create(
        model="x", prompt="class Stack:", max_tokens=6, temperature=0.8, seed=4
    )  # the 2nd answer: seed + 1
    assert several.choices[3].text == alone.choices[0].text
    streamed = list(
        remote.completions.create(
            model="x",
            prompt=[PROMPT, "class Stack:"],
            n=2,
            max_tokens=6,
            temperature=0.8,
            seed=3,
            stream=True,
        )
    )
    for index in range(4):
        text = "".join(c.choices[0].text for c in streamed if c.choices[0].index == index)
        assert text == several.choices[index].text


def test_openai_chat_streamed_or_not_with_parts_and_neutral_values(remote) -> None:
    answer = remote.chat.completions.create(
        model="x", messages=QUESTION, max_tokens=10, temperature=0
    )
    message = answer.choices[0].message
    assert message.role == "assistant"
    assert message.content
    halves = ["Write a function ", "that adds two numbers."]
    parts = [{"role": "user", "content": [{"type": "text", "text": half} for half in halves]}]
    same = remote.chat.completions.create(
        model="x",
        messages=parts,
        max_tokens=10,
        temperature=0,
        response_format={"type": "text"},
        store=False,
        presence_penalty=0,
    )
    assert same.choices[0].message.content == message.content
    usage = {"include_usage": True}
    chunks = list(
        remote.chat.completions.create(
            model="x",
            messages=QUESTION,
            max_tokens=10,
            temperature=0,
            stream=True,
            n=2,
            stream_options=usage,
        )
    )
    for index in range(2):  # greedy: both answers alike
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == index]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == message.content
    assert chunks[-1].usage.completion_tokens == 2 * answer.usage.completion_tokens


def test_openai_models_and_refusals(remote) -> None:
    assert [m.id for m in remote.models.list()] == ["hetspec-demo"]
    assert remote.models.retrieve("hetspec-demo").owned_by == "hetspec"
    with pytest.raises(openai.NotFoundError, match="'hetspec-demo'"):
        remote.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        remote.chat.completions.create(model="x", messages=QUESTION, frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        remote.chat.completions.create(
            model="x", messages=QUESTION, response_format={"type": "xml"}
        )
    wrong = openai.OpenAI(base_url=remote.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


# ---------------------------------------------------------------- log-probabilities


def reference_logprobs(prompt: str, tokens: list[int]) -> np.ndarray:
    """(tokens, vocab) log-softmax of the bundled target's logits before each token, from the
    torch runtime in this process, one token at a time: the target's own distribution."""
    target = TorchRuntime(BUNDLED_MODELS / "target", max_context=256)
    target.prefill(target.tokenize(prompt))
    rows = []
    for token in tokens:
        rows.append(torch.log_softmax(torch.from_numpy(target.last_logits()).double(), -1))
        target.append([token])
    return torch.stack(rows).numpy()


def test_logprobs_are_the_targets_own_in_every_mode(http, remote) -> None:
    """Whether a token came from a verified draft, the target decoding alone or the prefill,
    its log-probability is the target's own one-token-at-a-time value, with the top
    alternatives in order; OpenAI's and Ollama's forms carry the same numbers."""
    body = {
        "prompt": PROMPT,
        "raw": True,
        "stream": False,
        "logprobs": True,
        "top_logprobs": 3,
        "options": {"num_predict": 12},
        "ignore_eos": True,
    }
    answers = {
        mode: http.post("/api/generate", json={**body, "mode": mode}).json()
        for mode in ("autoregressive", "sequential", "parallel", "adaptive")
    }
    tokens = answers["autoregressive"]["tokens"]
    reference = reference_logprobs(PROMPT, tokens)
    for mode, answer in answers.items():
        assert answer["tokens"] == tokens, mode
        entries = answer["logprobs"]
        assert len(entries) == len(tokens), mode
        for row, entry, token in zip(reference, entries, tokens, strict=True):
            assert entry["logprob"] == pytest.approx(row[token], abs=1e-4), mode
            best = np.argsort(-row, kind="stable")[:3]
            assert [top["logprob"] for top in entry["top_logprobs"]] == pytest.approx(
                row[best], abs=1e-4
            )
            assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
    assert (
        "".join(e["token"] for e in answers["adaptive"]["logprobs"])
        == answers["adaptive"]["response"]
    )

    completion = remote.completions.create(
        model="x", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3
    )
    legacy = completion.choices[0].logprobs
    assert legacy.token_logprobs == pytest.approx(
        [e["logprob"] for e in answers["adaptive"]["logprobs"]], abs=1e-4
    )
    assert "".join(legacy.tokens) == completion.choices[0].text
    assert legacy.text_offset[1] == len(legacy.tokens[0])
    first = answers["adaptive"]["logprobs"][0]
    assert list(legacy.top_logprobs[0].values()) == pytest.approx(
        [top["logprob"] for top in first["top_logprobs"]], abs=1e-4
    )


def test_logprobs_streamed_or_not_through_real_clients(local, remote) -> None:
    """Streamed, each piece carries its own tokens' log-probabilities: together, the whole
    answer's, as the answer given at once has them (chat and generate)."""
    options = {"num_predict": 10, "temperature": 0}
    whole = local.chat(model="x", messages=QUESTION, options=options, logprobs=True, top_logprobs=2)
    pieces = list(
        local.chat(
            model="x",
            messages=QUESTION,
            options=options,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    streamed = [entry for piece in pieces for entry in piece.logprobs or []]
    assert [e.token for e in streamed] == [e.token for e in whole.logprobs]
    # (a prefix cached from the last request changes the prefill's last bits)
    assert [e.logprob for e in streamed] == pytest.approx(
        [e.logprob for e in whole.logprobs], abs=1e-4
    )
    assert len(whole.logprobs) == whole.eval_count
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in whole.logprobs)

    chat = remote.chat.completions.create(
        model="x", messages=QUESTION, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [e.token for e in whole.logprobs]
    assert [c.logprob for c in content] == pytest.approx(
        [e.logprob for e in whole.logprobs], abs=1e-4
    )
    assert bytes(content[0].bytes).decode() == content[0].token
    chunks = list(
        remote.chat.completions.create(
            model="x", messages=QUESTION, max_tokens=10, temperature=0, logprobs=True, stream=True
        )
    )
    streamed = [
        c
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(c.top_logprobs == [] for c in streamed)  # top_logprobs not asked
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        remote.chat.completions.create(model="x", messages=QUESTION, top_logprobs=2)
    with pytest.raises(ollama.ResponseError, match=r"0\.\.20"):
        local.generate(model="x", prompt="x", logprobs=True, top_logprobs=21)

"""Structured output through the real daemon on the bundled models, with the clients users
have: Ollama's ``format`` (the ``ollama`` package), OpenAI's ``response_format`` (the
``openai`` package's ``parse`` with a pydantic model), hetspec's ``grammar``; every answer
valid, speculation's text the target alone's under the same grammar, bad grammars 400s."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from real_daemon import ollama_client, openai_client, socket_http, tcp_daemon

pytestmark = pytest.mark.process

TOKEN = "test-token-structured-0123"
PROMPT = "def read_lines(path):\n"


class Reading(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    sensor: Literal["kitchen", "garage", "attic"]
    celsius: int = pydantic.Field(ge=-40, le=60)
    note: str = pydantic.Field(max_length=24)
    tags: list[Literal["ok", "check", "alarm"]] = pydantic.Field(max_length=3)


SCHEMA = Reading.model_json_schema()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with tcp_daemon(tmp_path_factory.mktemp("structured"), TOKEN) as daemon:
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


def generate(http, **body) -> dict:
    body = {"prompt": PROMPT, "raw": True, "stream": False, **body}
    reply = http.post("/api/generate", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("mode", ["autoregressive", "sequential", "adaptive"])
def test_ollamas_format_gives_valid_json_in_every_mode(local, mode) -> None:
    reply = local.generate(
        model="any",
        prompt=PROMPT,
        raw=True,
        format=SCHEMA,
        options={"num_predict": 200, "temperature": 0},
    )
    assert reply.done_reason == "stop"
    Reading.model_validate_json(reply.response)
    assert isinstance(
        json.loads(local.generate(model="x", prompt=PROMPT, format="json").response), dict
    )


def test_speculation_keeps_the_constrained_targets_text(http) -> None:
    """Greedy and seeded: every mode's text is the target alone's under the same grammar."""
    for options in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
        texts = {
            mode: generate(http, format=SCHEMA, mode=mode, options={**options, "num_predict": 200})
            for mode in ("autoregressive", "sequential", "adaptive")
        }
        alone = texts["autoregressive"]["response"]
        jsonschema.validate(json.loads(alone), SCHEMA)
        assert all(reply["response"] == alone for reply in texts.values()), texts
    alone = texts["autoregressive"]["speculative"]  # the target alone masks in its worker
    assert alone["grammar_worker_masks"] > 0
    adaptive = generate(http, format=SCHEMA, mode="adaptive", options={"temperature": 0})
    assert adaptive["speculative"]["grammar_forced"] > 0  # keys and separators
    assert adaptive["speculative"]["grammar_masks"] >= len(adaptive["tokens"])


def test_sampled_answers_are_all_valid(http) -> None:
    for seed in range(6):
        reply = generate(http, format=SCHEMA, options={"temperature": 1.0, "seed": seed})
        jsonschema.validate(json.loads(reply["response"]), SCHEMA)


def test_openais_parse_returns_the_pydantic_model(remote) -> None:
    completion = remote.chat.completions.parse(
        model="any",
        messages=[{"role": "user", "content": "Report the kitchen sensor."}],
        response_format=Reading,
        temperature=0,
        max_tokens=200,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Reading)
    plain = remote.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Any JSON."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    assert isinstance(json.loads(plain.choices[0].message.content), dict)


def test_a_regular_expression_and_a_gbnf_grammar(http) -> None:
    regex = r"(yes|no), because [a-z ]{1,40}\."
    reply = generate(http, grammar={"type": "regex", "value": regex}, options={"num_predict": 60})
    assert re.fullmatch(regex, reply["response"]), reply["response"]
    gbnf = 'root ::= "x = " [0-9]+ "\\n"'
    reply = generate(http, grammar={"type": "gbnf", "value": gbnf}, options={"num_predict": 30})
    assert re.fullmatch(r"x = [0-9]+\n", reply["response"]), reply["response"]


def test_a_token_limit_mid_object_says_length_and_returns_the_partial_text(http) -> None:
    reply = generate(http, format=SCHEMA, options={"num_predict": 5, "temperature": 0})
    assert reply["done_reason"] == "length"
    assert reply["response"].startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(reply["response"])


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"grammar": {"type": "regex", "value": "(unclosed"}}, "grammar"),
        ({"grammar": {"type": "lark", "value": "start: ]"}}, "grammar"),
        ({"grammar": {"type": "gbnf", "value": "root ::= missing"}}, "grammar"),
        ({"grammar": {"type": "cfg", "value": "x"}}, "grammar type"),
        ({"format": "xml"}, "format"),
        ({"format": "json", "grammar": {"type": "regex", "value": "a"}}, "not both"),
        ({"format": "json", "ignore_eos": True}, "ignore_eos"),
        ({"format": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "format: "),
    ],
)
def test_bad_grammars_are_400s_naming_the_problem(http, body, named) -> None:
    reply = http.post("/api/generate", json={"prompt": PROMPT, "stream": False, **body})
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"], reply.json()


def test_openai_response_format_errors(remote) -> None:
    for response_format in ({"type": "yaml"}, {"type": "json_schema"}):
        with pytest.raises(openai.BadRequestError, match="response_format"):
            remote.chat.completions.create(
                model="any",
                messages=[{"role": "user", "content": "hi"}],
                response_format=response_format,
                max_tokens=8,
            )


def test_an_enormous_schema_is_refused_and_the_daemon_keeps_serving(http) -> None:
    huge = {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": "string", "pattern": "[a-z]{1,8}"} for i in range(20_000)
        },
    }
    reply = http.post("/api/generate", json={"prompt": PROMPT, "stream": False, "format": huge})
    assert reply.status_code == 400
    assert "format: " in reply.json()["error"]
    generate(http, format="json", options={"num_predict": 40})

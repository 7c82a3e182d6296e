"""Tool calls on /v1/chat/completions: the grammars built from the tools accept exactly calls
(and, for ``auto``, text), the prompt tells a ChatML model of the tools and of earlier calls,
a reply reads back as OpenAI's ``tool_calls``; then a real daemon on the bundled models,
driven with the ``openai`` package: a round trip, required, named and auto choices, a
streamed call equal to the whole one, bad tools refused naming the field; and Ollama's
/api/chat ``tools`` with the ``ollama`` package."""

from __future__ import annotations

import json

import httpx
import jsonschema
import llguidance
import msgspec
import ollama
import openai
import pytest
from real_daemon import ollama_client, openai_client, tcp_daemon

from hetspec.daemon.api.chat_template import ChatMessage, ChatTemplate, load_chat_template
from hetspec.daemon.api.ollama import ReplyFields
from hetspec.daemon.api.openai import ChatRequest
from hetspec.daemon.api.tool_calls import (
    NamedToolChoice,
    ReplyReader,
    Tool,
    ToolUse,
    chat_prompt,
    tool_use,
    whole_reply,
)
from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.speculative.constrain.token_table import grammar_tokenizer

TOKEN = "test-token-tool-calls-0123"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"$ref": "#/$defs/City"},  # pydantic's layout: references into $defs
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
    "$defs": {"City": {"type": "string", "maxLength": 12}},
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time.", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def tools() -> list[Tool]:
    return msgspec.convert(TOOLS, list[Tool])


# ------------------------------------------------------------------ grammars, no process

END = 256  # a vocabulary of the 256 bytes and an end token: text is matched byte for byte
BYTES = grammar_tokenizer([bytes([b]) for b in range(256)] + [b"<end>"], [], [END])


def accepts(use: ToolUse, text: str) -> bool:
    """Whether ``use``'s grammar takes ``text`` as a whole answer."""
    matcher = llguidance.LLMatcher(BYTES, use.grammar().text())
    return matcher.consume_tokens([*text.encode(), END]) and not matcher.is_error()


CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


def test_required_takes_exactly_a_call_to_one_of_the_tools() -> None:
    required = ToolUse(tools(), "required")
    assert accepts(required, CALL)
    assert accepts(required, '{"name": "get_time", "arguments": {"zone": "UTC"}}')
    for wrong in (
        "Sunny.",  # text
        '{"name": "get_time", "arguments": {"city": "Paris", "unit": "celsius"}}',  # mixed up
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # a required argument left out
        '{"name": "get_weather", "arguments": {"city": "Paris-sur-Seine-X", "unit": "celsius"}}',
        '{"name": "launch", "arguments": {}}',
        CALL[:-1],  # cut short
        " " + CALL,
    ):
        assert not accepts(required, wrong), wrong


def test_a_recursive_schema_refers_to_its_own_root() -> None:
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "tree", "parameters": tree}}
    required = ToolUse(msgspec.convert([tool], list[Tool]), "required")
    assert accepts(required, '{"name": "tree", "arguments": {"child": {"child": {}}}}')
    assert not accepts(required, '{"name": "tree", "arguments": {"child": {"leaf": {}}}}')


def test_a_named_choice_takes_that_tool_alone() -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    named = tool_use(tools(), msgspec.convert(choice, NamedToolChoice))
    assert (named.choice, named.named) == ("required", "get_time")
    assert accepts(named, '{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert not accepts(named, CALL)


def test_auto_takes_a_call_or_text_that_does_not_begin_like_one() -> None:
    auto = ToolUse(tools(), "auto")
    for good in (CALL, "\n " + CALL, "It is sunny {really}.", "  two\nlines", "x"):
        assert accepts(auto, good), good
    for wrong in ("{not a call}", '  {"name": "launch", "arguments": {}}', CALL + " and more"):
        assert not accepts(auto, wrong), wrong
    assert ToolUse(tools(), "none").grammar() is None


def test_the_choice_and_the_tools_are_checked_naming_the_field() -> None:
    def refused(body: dict) -> str:
        with pytest.raises(msgspec.ValidationError) as error:
            msgspec.json.decode(json.dumps({"messages": QUESTION, **body}), type=ChatRequest)
        return str(error.value)

    assert "tool_choice names 'launch'" in refused(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}
    )
    assert "tool_choice must be" in refused({"tools": TOOLS, "tool_choice": "always"})
    assert "tool_choice needs tools" in refused({"tool_choice": "required"})
    bad = {
        **TOOLS[0]["function"],
        "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
    }
    assert "tools[1].function.parameters (get_weather): invalid JSON schema" in refused(
        {"tools": [TOOLS[1], {"type": "function", "function": bad}]}
    )
    assert "tools[1].function.name 'get_time' is given twice" in refused({"tools": [TOOLS[1]] * 2})
    assert "function.name must be" in refused(
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]}
    )
    json_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": TIME}}
    assert "response_format cannot constrain" in refused(
        {"tools": TOOLS, "response_format": json_format}
    )
    # with tool_choice none the tools constrain nothing, so response_format may
    body = {
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": "none",
        "response_format": json_format,
    }
    request = msgspec.json.decode(json.dumps(body), type=ChatRequest)
    assert request.wanted_grammar().field == "response_format"


# ------------------------------------------------------------------ prompt and reply, no process

ROUND_TRIP = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="Weather in Paris?"),
    msgspec.convert(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        ChatMessage,
    ),
    ChatMessage(role="tool", tool_call_id="call_1", content="18 C"),
]


def test_a_chatml_prompt_lists_the_tools_and_writes_calls_and_results_as_text() -> None:
    template = load_chat_template(BUNDLED_MODELS / "target")
    assert not template.handles_tools
    assert template.renders_any_role
    prompt = chat_prompt(template, ROUND_TRIP, ToolUse(tools(), "auto"))
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou have these tools:\n")
    assert (
        '- get_weather: The weather in a city. Parameters (JSON schema): {"type": "object"'
        in system
    )
    assert "To call a tool, answer with only the JSON object" in system
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in prompt  # the grammar's own layout
    assert "<|im_start|>tool\nThe result of get_weather (call call_1):\n18 C<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # a template that writes only the roles it knows: the result comes as the user's
    known = ChatTemplate(
        "{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}"
        "[{{ m.role }}] {{ m.content }}\n{% endif %}{% endfor %}"
    )
    assert not known.renders_any_role
    prompt = chat_prompt(known, ROUND_TRIP, ToolUse(tools(), "required"))
    assert "[user] The result of get_weather (call call_1):\n18 C" in prompt
    assert "Call one of the tools: answer with only the JSON object" in prompt
    # no system message of its own: one is added first
    assert chat_prompt(known, ROUND_TRIP[1:2], ToolUse(tools(), "none")).startswith(
        "[system] You have these tools:"
    )


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_values() -> None:
    template = ChatTemplate(
        "{% for t in tools %}<tool>{{ t.function.name }}</tool>{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "<call {{ c.id }}>{{ c.function.name }}({{ c.function.arguments.city }})</call>"
        "{% endfor %}{% if m.role == 'tool' %}<result {{ m.tool_call_id }}>{{ m.content }}"
        "</result>{% endif %}{% endfor %}"
    )
    assert template.handles_tools
    prompt = chat_prompt(template, ROUND_TRIP, ToolUse(tools(), "auto"))
    assert prompt == (
        "<tool>get_weather</tool><tool>get_time</tool>"
        "<call call_1>get_weather(Paris)</call><result call_1>18 C</result>"
    )


def test_messages_of_a_round_trip_are_checked() -> None:
    with pytest.raises(ValueError, match="only an assistant's message with tool_calls"):
        ChatMessage(role="user", content=None)
    with pytest.raises(ValueError, match="tool_call_id belongs to tool messages"):
        ChatMessage(role="user", content="x", tool_call_id="call_1")
    with pytest.raises(ValueError, match="tool_calls belong to assistant messages"):
        ChatMessage(role="user", content="x", tool_calls=ROUND_TRIP[2].tool_calls)


def test_a_streamed_reply_accumulates_to_the_whole_one() -> None:
    for must_call, text, reason in (
        (True, CALL, "stop"),
        (False, "\n " + CALL, "stop"),
        (False, "  It is sunny.", "stop"),
        (False, CALL[:30], "length"),  # cut short before the arguments: text
        (True, CALL[:50], "length"),  # within them: the call as far as it went
    ):
        whole, whole_reason = whole_reply(text, reason, must_call)
        reader = ReplyReader(must_call)
        deltas = [reader.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
        last, streamed_reason = reader.finish(reason)
        content, arguments, head = "", "", None
        for delta in [*deltas, last]:
            if delta is None:
                continue
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                head = head or call
                arguments += call["function"]["arguments"]
        assert streamed_reason == whole_reason
        if "tool_calls" in whole:
            assert whole["content"] is None
            assert not content
            assert head["function"]["name"] == whole["tool_calls"][0]["function"]["name"]
            assert arguments == whole["tool_calls"][0]["function"]["arguments"]
        else:
            assert head is None
            assert content == whole["content"]
    message, reason = whole_reply(CALL, "stop", True)
    assert reason == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_")
    assert call["type"] == "function"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    cut, reason = whole_reply(CALL[:50], "length", True)  # the arguments as far as they went
    assert reason == "length"
    assert cut["tool_calls"][0]["function"]["arguments"] == CALL[:50].split('"arguments": ')[1]
    assert whole_reply(CALL[:20], "length", True)[0]["content"] == CALL[:20]  # no name yet


def test_ollamas_chat_sends_a_call_whole_in_the_last_object() -> None:
    reply = ReplyFields(lambda text: {"message": {"role": "assistant", "content": text}}, True)
    assert [reply.piece(CALL[i : i + 4]) for i in range(0, len(CALL), 4)] == [None] * 19
    fields, reason = reply.last("", "stop")
    assert reason == "stop"
    assert fields == {
        "message": {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Paris", "unit": "celsius"},
                    }
                }
            ],
        }
    }
    text = ReplyFields(lambda text: {"response": text}, True)
    assert text.piece(" ") is None  # undecided until the first non-space character
    assert text.piece(" Sunny") == {"response": "  Sunny"}
    assert text.last("", "length") == ({"response": ""}, "length")  # all sent already
    cut = ReplyFields(lambda text: {"response": text}, True)
    assert cut.piece(CALL[:20]) is None
    assert cut.last("", "length") == ({"response": CALL[:20]}, "length")  # a call cut short


# ------------------------------------------------------------------ a real daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with tcp_daemon(tmp_path_factory.mktemp("tools"), TOKEN) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def client(daemon):
    return openai_client(daemon, TOKEN)


def ask(client, **fields):
    body = {"model": "any", "messages": QUESTION, "tools": TOOLS, "max_tokens": 120, **fields}
    return client.chat.completions.create(**body)


def assert_valid_call(call) -> dict:
    assert call.type == "function"
    assert call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.process
def test_a_tool_call_round_trip(client) -> None:
    first = ask(client, tool_choice="required", temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert_valid_call(call)
    # the SDK's own message object goes back as it came, then the tool's result
    messages = [
        *QUESTION,
        choice.message,
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    second = ask(client, messages=messages, tool_choice="none", temperature=0, max_tokens=24)
    answer = second.choices[0]
    assert answer.message.tool_calls is None
    assert isinstance(answer.message.content, str)
    assert answer.message.content
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.process
def test_a_named_choice_calls_that_tool(client) -> None:
    for seed in range(3):
        reply = ask(
            client,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=1.0,
            seed=seed,
        )
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        assert_valid_call(call)


@pytest.mark.process
def test_auto_answers_a_valid_call_or_text(client) -> None:
    """The bundled model, trained on code, answers text (a fence) where it may choose: the
    call path of ``auto`` is the unit tests' (``ReplyReader``), the grammar's above."""
    kinds = set()
    for seed in range(6):
        choice = ask(client, temperature=1.0, seed=seed).choices[0]
        chunks = list(ask(client, temperature=1.0, seed=seed, stream=True))
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        assert "".join(delta.content or "" for delta in deltas) == (choice.message.content or "")
        assert [d.tool_calls is not None for d in deltas].count(True) == (
            len(deltas) - 1 if choice.message.tool_calls else 0
        )
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            assert_valid_call(choice.message.tool_calls[0])
            kinds.add("call")
        else:
            assert not choice.message.content.lstrip().startswith("{")
            assert choice.finish_reason in ("stop", "length")
            kinds.add("text")
    assert kinds  # the model chose; whichever it was is well-formed


@pytest.mark.process
def test_a_streamed_call_accumulates_to_the_whole_one(client) -> None:
    fields = {"tool_choice": "required", "temperature": 0, "max_tokens": 120}
    whole = ask(client, **fields).choices[0]
    with client.chat.completions.stream(
        model="any", messages=QUESTION, tools=TOOLS, **fields
    ) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    (mine,), (theirs,) = streamed.message.tool_calls, whole.message.tool_calls
    assert (mine.function.name, mine.function.arguments) == (
        theirs.function.name,
        theirs.function.arguments,
    )
    assert_valid_call(mine)
    # the raw chunks: the id, type and name first, the arguments in pieces after
    chunks = list(ask(client, stream=True, **fields))
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert calls[0].id.startswith("call_")
    assert calls[0].function.name == theirs.function.name
    assert all(call.index == 0 and call.id is None for call in calls[1:])
    assert "".join(call.function.arguments for call in calls) == theirs.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.process
@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "nonsense"}},
                    }
                ]
            },
            "tools[0].function.parameters (f)",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "t", "schema": TIME},
                }
            },
            "response_format",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(client, fields, named) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, **fields)
    assert refused.value.status_code == 400
    assert named in str(refused.value)


@pytest.mark.process
def test_tools_beside_a_plain_request_change_nothing_else(daemon) -> None:
    """No tools: the reply has no tool_calls and keeps its finish_reason (a plain HTTP client
    sees the same shape as before)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=120) as http:
        reply = http.post(
            "http://hetspecd/v1/chat/completions",
            json={"messages": QUESTION, "max_tokens": 8, "temperature": 0},
        ).json()
    message = reply["choices"][0]["message"]
    assert set(message) == {"role", "content"}
    assert isinstance(message["content"], str)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")


# ------------------------------------------------------------------ Ollama's /api/chat


@pytest.fixture(scope="module")
def local(daemon):
    with ollama_client(daemon) as client:
        yield client


def ollama_reply(local, stream: bool, **fields):
    """The reply's content, calls and done_reason; streamed: the pieces accumulated."""
    body = {"model": "x", "messages": QUESTION, "tools": TOOLS, "stream": stream, **fields}
    if not stream:
        reply = local.chat(**body)
        return reply.message.content, reply.message.tool_calls, reply.done_reason
    content, calls, reason = "", None, None
    for part in local.chat(**body):
        content += part.message.content or ""
        calls = part.message.tool_calls or calls
        reason = part.done_reason or reason
    return content, calls, reason


@pytest.mark.process
def test_ollamas_chat_answers_a_call_or_text_streamed_or_not(local) -> None:
    kinds = set()
    for seed in range(6):
        options = {"temperature": 1.0, "seed": seed, "num_predict": 120}
        whole = ollama_reply(local, False, options=options)
        assert ollama_reply(local, True, options=options) == whole  # seeded: the same answer
        content, calls, reason = whole
        if calls:
            (call,) = calls
            jsonschema.validate(dict(call.function.arguments), SCHEMAS[call.function.name])
            assert content == ""
            assert reason == "stop"
            kinds.add("call")
        else:
            assert not content.lstrip().startswith("{")
            kinds.add("text")
    assert kinds


@pytest.mark.process
def test_ollamas_chat_round_trip_and_tools_beside_format(local) -> None:
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
    messages = [
        *QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_name": "get_weather", "content": "18 degrees, sunny"},
    ]
    reply = local.chat(model="x", messages=messages, options={"num_predict": 24, "temperature": 0})
    assert isinstance(reply.message.content, str)
    assert reply.done_reason in ("stop", "length")
    with pytest.raises(ollama.ResponseError, match="format cannot constrain"):
        local.chat(model="x", messages=QUESTION, tools=TOOLS, format="json")


@pytest.mark.process
def test_ollamas_chat_refuses_bad_tools_naming_them(daemon) -> None:
    # raw: the ollama package itself refuses a parameters schema whose type is not "object"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=120) as http:
        reply = http.post("http://hetspecd/api/chat", json={"messages": QUESTION, "tools": bad})
    assert reply.status_code == 400
    assert "tools[0].function.parameters (f)" in reply.json()["error"]

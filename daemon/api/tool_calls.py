"""Tool calls on the chat endpoints: the tools a request offers, the grammar its answer keeps,
the prompt that tells the model of them, and a call read back out of the answer.

A call is the JSON object ``{"name": <a tool's name>, "arguments": <its arguments>}``, one per
answer, kept valid by a grammar built from the tools (llguidance's Lark with each tool's
schema inline as ``%json``): ``required`` or a named tool, the answer is such a call; ``auto``,
a call or free text (text whose first character after any whitespace is not ``{``); ``none``,
no grammar. The grammar constrains the target losslessly like any other (see structured.py).
Templates that render ``tools`` themselves get them; others (ChatML's) get a system message
that lists them and says how to call one, and the calls and results of earlier turns as text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import llguidance
import msgspec

from hetspec.daemon.api.chat_template import ChatMessage, ChatTemplate
from hetspec.daemon.api.structured import FieldGrammar
from hetspec.speculative.constrain.grammars import (
    JSON_OPTIONS,
    MAX_GRAMMAR_CHARS,
    parser_limits,
)

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}
# the head of a call as the grammar lays it out: the name is known once it is complete
CALL_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')
# keywords whose values are data, not schemas: a "$ref" in them is not a reference
_DATA_KEYWORDS = {"const", "enum", "default", "examples"}


class FunctionSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # every schema is enforced: strict or not, the same


class Tool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    function: FunctionSpec

    def as_dict(self) -> dict:
        """OpenAI's tool object, for templates that render ``tools``."""
        function = msgspec.to_builtins(self.function)
        function.setdefault("parameters", NO_PARAMETERS)
        return {"type": "function", "function": function}


class ChosenFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    function: ChosenFunction


@dataclass(frozen=True)
class ToolUse:
    """What a request's ``tools`` and ``tool_choice`` ask: ``choice`` one of ``CHOICES``,
    ``named`` the one tool a named choice requires."""

    tools: list[Tool]
    choice: str
    named: str | None = None

    @property
    def may_call(self) -> bool:
        return self.choice != "none"

    @property
    def must_call(self) -> bool:
        return self.choice == "required"

    def callable_tools(self) -> list[Tool]:
        if self.named is None:
            return self.tools
        return [tool for tool in self.tools if tool.function.name == self.named]

    def grammar(self) -> FieldGrammar | None:
        """The grammar the answer keeps (None: ``none``, free text); its errors name
        ``tools``."""
        if not self.may_call:
            return None
        text = tools_lark(self.callable_tools(), free_text=not self.must_call)
        return FieldGrammar("lark", text, source="tools")


def tool_use(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None):
    """The request's ``ToolUse`` (None: no tools), for tools ``check_tools`` passed;
    ValueError naming the field where the choice is wrong."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    if tool_choice is None or isinstance(tool_choice, str):
        choice = tool_choice or "auto"
        if choice not in CHOICES:
            raise ValueError(
                f"tool_choice must be none, auto, required or a function, not {choice!r}"
            )
        return ToolUse(tools, choice)
    if tool_choice.type != "function":
        raise ValueError(f'tool_choice type must be "function", not {tool_choice.type!r}')
    name = tool_choice.function.name
    if name not in {tool.function.name for tool in tools}:
        raise ValueError(f"tool_choice names {name!r}, which is not in tools")
    return ToolUse(tools, "required", name)


def check_tools(tools: list[Tool] | None) -> None:
    """ValueError naming the tool and its field where one is wrong: its type, its name (or
    a name given twice), its parameters' schema (compiled here, without a vocabulary: a bad
    schema is a 400 naming its tool, in about a millisecond)."""
    if len(tools or []) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools, not {len(tools)}")
    seen = set()
    for index, tool in enumerate(tools or []):
        where = f"tools[{index}]"
        if tool.type != "function":
            raise ValueError(f'{where}.type must be "function", not {tool.type!r}')
        name = tool.function.name
        if not TOOL_NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1-64 of a-z A-Z 0-9 _ -: {name!r}")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        schema = json.dumps(call_schema(tool))
        if len(schema) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"{where}.function.parameters has {len(schema):,} characters; at most "
                f"{MAX_GRAMMAR_CHARS:,} are taken"
            )
        error = llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(schema), limits=parser_limits()
        )
        if error:
            line = error.strip().splitlines()[0][:500]
            raise ValueError(f"{where}.function.parameters ({name}): invalid JSON schema: {line}")


# ------------------------------------------------------------------ the grammar


def call_schema(tool: Tool) -> dict:
    """The JSON schema of a call to ``tool``: ``{"name": its name, "arguments": its
    parameters}``, in the layout of every grammar's JSON (``JSON_OPTIONS``). The parameters
    move under ``$defs`` and their local references (``#/...``) follow them."""
    parameters = tool.function.parameters
    parameters = _relocated(
        NO_PARAMETERS if parameters is None else parameters, "#/$defs/arguments"
    )
    for root_only in ("$id", "$schema"):  # an $id would rebase the references
        parameters.pop(root_only, None)
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": {"$ref": "#/$defs/arguments"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "$defs": {"arguments": parameters},
        "x-guidance": JSON_OPTIONS,
    }


def _relocated(schema: Any, root: str) -> Any:
    """A copy of ``schema`` whose local references (``#``, ``#/...``) point below ``root``
    (anchors and other documents' references are left as they are)."""
    if isinstance(schema, list):
        return [_relocated(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    copy = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            copy[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            copy[key] = value
        else:
            copy[key] = _relocated(value, root)
    return copy


def tools_lark(tools: list[Tool], *, free_text: bool) -> str:
    """The Lark grammar of an answer that calls one of ``tools`` (each call's schema inline
    as ``%json``) or, with ``free_text``, may instead be text whose first character after
    any whitespace is not ``{``."""
    calls = [f"call_{index}" for index in range(len(tools))]
    rules = [
        f"{rule}: %json {json.dumps(call_schema(tool))}"
        for rule, tool in zip(calls, tools, strict=True)
    ]
    if not free_text:
        return "\n".join([f"start: {' | '.join(calls)}", *rules]) + "\n"
    return (
        "\n".join(
            [
                f"start: space? ({' | '.join(calls)} | text)",
                r"space: /[ \t\r\n]+/",
                r"text: /[^{ \t\r\n][\s\S]*/",
                *rules,
            ]
        )
        + "\n"
    )


# ------------------------------------------------------------------ the prompt


def chat_prompt(template: ChatTemplate, messages: list[ChatMessage], use: ToolUse | None) -> str:
    """The prompt for ``messages`` with the tools ``use`` offers: a template that renders
    ``tools`` gets them and the messages as they are; another gets the tools in the system
    message and earlier calls and results as text (see ``plain_messages``). ``ChatTemplateError``
    as ``render``."""
    if template.handles_tools:
        return template.render(messages, [tool.as_dict() for tool in use.tools] if use else None)
    plain = plain_messages(messages, template.renders_any_role)
    if use is not None:
        plain = with_system_text(plain, tools_instructions(use))
    return template.render(plain)


def plain_messages(messages: list[ChatMessage], tool_role: bool) -> list[ChatMessage]:
    """``messages`` for a template that knows nothing of tools: an assistant's calls as
    their JSON text (the grammar's layout: what the model itself answers), a tool's result as
    a message saying which call it answers, of role ``tool`` where the template renders any
    role (``tool_role``), else ``user``."""
    names = {}  # a call's id -> its tool's name, for results that do not say
    plain = []
    for message in messages:
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                names[call.id] = call.function.name
                calls.append(
                    json.dumps({"name": call.function.name, "arguments": call.arguments()})
                )
            text = "\n".join([message.text, *calls] if message.text else calls)
            plain.append(ChatMessage(role="assistant", content=text))
        elif message.role == "tool":
            name = message.name or names.get(message.tool_call_id or "") or "the tool"
            call = f" (call {message.tool_call_id})" if message.tool_call_id else ""
            text = f"The result of {name}{call}:\n{message.text}"
            plain.append(ChatMessage(role="tool" if tool_role else "user", content=text))
        else:
            plain.append(message)
    return plain


def with_system_text(messages: list[ChatMessage], text: str) -> list[ChatMessage]:
    """``text`` after the first message's where that is a system (or developer) message,
    else in a system message of its own before the others."""
    if messages and messages[0].role in ("system", "developer"):
        first = messages[0]
        merged = f"{first.text}\n\n{text}" if first.text else text
        return [ChatMessage(role=first.role, content=merged), *messages[1:]]
    return [ChatMessage(role="system", content=text), *messages]


def tools_instructions(use: ToolUse) -> str:
    """The system text that offers the tools to a model whose template does not: each
    tool's name, description and parameters' schema, and how to call one."""
    lines = ["You have these tools:"]
    for tool in use.tools:
        function = tool.function
        described = f": {function.description}" if function.description else ""
        parameters = json.dumps(function.parameters or NO_PARAMETERS)
        lines.append(f"- {function.name}{described} Parameters (JSON schema): {parameters}")
    shape = '{"name": <the tool\'s name>, "arguments": <its arguments, a JSON object>}'
    if use.choice == "none":
        lines.append("Answer in plain text now; do not call a tool.")
    elif use.named is not None:
        lines.append(f"Call the tool {use.named}: answer with only the JSON object {shape}.")
    elif use.must_call:
        lines.append(f"Call one of the tools: answer with only the JSON object {shape}.")
    else:
        lines.append(
            f"To call a tool, answer with only the JSON object {shape}; otherwise answer in "
            "plain text."
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ the reply


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ReplyReader:
    """One answer's text, read as it streams, into OpenAI chat deltas: its content, or the
    call it makes. ``must_call``: the grammar allows only a call; otherwise the answer is a
    call if its first character after any whitespace is ``{`` (held back until then). A
    call's arguments stream as they come but for the last character, the call's own ``}``."""

    def __init__(self, must_call: bool) -> None:
        self.state = "call" if must_call else "undecided"  # -> text | call -> arguments
        self.held = ""
        self.id = call_id()

    def feed(self, text: str) -> dict | None:
        """The delta for ``text`` (None: nothing to send yet)."""
        self.held += text
        if self.state == "undecided":
            begun = self.held.lstrip()
            if not begun:
                return None
            if begun[0] != "{":
                self.state = "text"
            else:
                self.state, self.held = "call", begun
        if self.state == "text":
            held, self.held = self.held, ""
            return {"content": held}
        delta = None
        if self.state == "call":
            head = CALL_HEAD.match(self.held)
            if head is None:
                return None
            self.state, self.held = "arguments", self.held[head.end() :]
            delta = self._call_delta({"name": head.group(1), "arguments": ""}, first=True)
        arguments, self.held = self.held[:-1], self.held[-1:]
        if delta is not None:
            delta["tool_calls"][0]["function"]["arguments"] = arguments
            return delta
        return self._call_delta({"arguments": arguments}) if arguments else None

    def finish(self, done_reason: str) -> tuple[dict | None, str]:
        """The last delta (None: none) and the choice's ``finish_reason``: ``tool_calls``
        where a whole call was made; a call cut short ends with what it had, as it ended."""
        held, self.held = self.held, ""
        if self.state == "arguments":
            if held == "}" and done_reason == "stop":
                return None, "tool_calls"
            return (self._call_delta({"arguments": held}) if held else None), done_reason
        return ({"content": held} if held else None), done_reason

    def _call_delta(self, function: dict, first: bool = False) -> dict:
        call = {"index": 0, "id": self.id, "type": "function", "function": function}
        if not first:
            call = {"index": 0, "function": function}
        return {"content": None, "tool_calls": [call]} if first else {"tool_calls": [call]}


def whole_reply(text: str, done_reason: str, must_call: bool) -> tuple[dict, str]:
    """A whole answer's ``message`` and ``finish_reason``: as ``ReplyReader``'s deltas
    accumulate, so that a streamed answer and a whole one say the same."""
    reader = ReplyReader(must_call)
    first = reader.feed(text)
    last, reason = reader.finish(done_reason)
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for delta in (first, last):
        if delta is None:
            continue
        if delta.get("content"):
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            if "id" in call:
                message["tool_calls"] = [
                    {"id": call["id"], "type": "function", "function": dict(call["function"])}
                ]
            else:
                message["tool_calls"][0]["function"]["arguments"] += call["function"]["arguments"]
    if message["content"] is None and "tool_calls" not in message:
        message["content"] = ""
    return message, reason

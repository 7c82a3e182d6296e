"""Chat messages to a prompt, with the target model's own chat template.

The template comes from the model folder's ``tokenizer_config.json`` (``chat_template``) or,
failing that, the GGUF file's ``tokenizer.chat_template``; it is rendered in Jinja's sandbox,
with the variables Hugging Face templates expect. Models mark the end of an assistant turn
with a special token that is not always their EOS; the markers a template uses become
implicit stop strings, so a chat answer ends with its turn.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hetspec.protocol.gguf_header import read_gguf_header
from hetspec.protocol.tokenizer_files import END_OF_TURN_TEXTS, adds_bos, special_token_text

# end-of-turn markers of common template families (ChatML, Llama 3, Phi, Gemma; Llama 2's </s>)
TURN_ENDS = (*END_OF_TURN_TEXTS, "</s>")
ROLES = ("system", "user", "assistant", "developer", "tool")


class ChatTemplateError(ValueError):
    pass


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content given as a list (OpenAI's form): text only."""

    type: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.type != "text":
            raise ValueError(
                f"content parts of type {self.type!r} are not supported: the model reads text only"
            )


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A call an assistant message made (OpenAI's ``tool_calls`` entry)."""

    id: str = ""
    type: str = "function"
    function: CalledFunction

    def arguments(self) -> Any:
        """The arguments as a value (templates index them): the JSON text parsed, or the
        text itself where it is not JSON."""
        try:
            return json.loads(self.function.arguments)
        except ValueError:
            return self.function.arguments


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A message; an assistant's may hold ``tool_calls`` (its content then may be null), a
    ``tool`` message answers the call ``tool_call_id`` names (``name``: the tool's)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an assistant message sent back as the API returned it

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(
                f"role must be {', '.join(ROLES[:-1])} or {ROLES[-1]}, not {self.role!r}"
            )
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs to tool messages")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                f"a {self.role} message needs content (only an assistant's "
                "message with tool_calls may leave it null)"
            )

    @property
    def text(self) -> str:
        """The content as one text: a list of text parts joined as given (null: empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_form(self) -> dict:
        """The message as Hugging Face chat templates read it (a call's arguments as a
        value, the content a string: templates concatenate it)."""
        form: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            form["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.arguments()},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            form["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            form["name"] = self.name
        return form


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(
        self, source: str, bos_token: str = "", eos_token: str = "", *, adds_bos: bool = False
    ) -> None:
        """``adds_bos``: the target's tokenizer puts BOS before every prompt itself, so a
        rendered prompt's leading BOS text is dropped (one BOS, not two: llama.cpp's rule)."""
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the model's chat template does not parse: {error}") from None
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.adds_bos = adds_bos
        self.stops = [marker for marker in TURN_ENDS if marker in source and marker != eos_token]

    @property
    def handles_tools(self) -> bool:
        """The template renders a ``tools`` list itself (Hugging Face's convention)."""
        return "tools" in self.source

    @functools.cached_property
    def renders_any_role(self) -> bool:
        """A message of role ``tool`` comes out under its own role (ChatML's templates write
        whatever role they get; others refuse it or drop it)."""
        mark = "\u2063probe\u2063"
        try:
            prompt = self.render([ChatMessage(role="tool", content=mark)])
        except ChatTemplateError:
            return False
        return mark in prompt and "tool" in prompt.replace(mark, "")

    def render(self, messages: list[ChatMessage], tools: list[dict] | None = None) -> str:
        """The prompt for these messages, ending where the assistant's answer begins;
        ``tools`` (OpenAI's tool objects) passed to a template that renders them."""
        variables = {"tools": tools} if tools else {}
        try:
            prompt = self._template.render(
                messages=[message.template_form() for message in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **variables,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(
                f"the chat template failed on these messages: {error}"
            ) from None
        if self.adds_bos and self.bos_token and prompt.startswith(self.bos_token):
            return prompt[len(self.bos_token) :]
        return prompt


def load_chat_template(folder: str | Path, gguf: str | Path | None = None) -> ChatTemplate | None:
    """The target model's template, or None when neither export carries one; ``folder`` may
    be "" (a GGUF-only model: the template, BOS, EOS and add-BOS are then the GGUF's)."""
    config = _folder_json(Path(folder) / "tokenizer_config.json") if folder else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not source and gguf:
        return _gguf_chat_template(Path(gguf))
    if not source:
        return None
    bos = bool(config) and adds_bos(config, _folder_json(Path(folder) / "tokenizer.json"))
    return ChatTemplate(
        source,
        special_token_text(config, "bos_token"),
        special_token_text(config, "eos_token"),
        adds_bos=bos,
    )


def _folder_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _gguf_chat_template(path: Path) -> ChatTemplate | None:
    """The GGUF's template with its BOS and EOS texts and whether it adds BOS, as llama.cpp
    renders it."""
    try:
        fields = read_gguf_header(path, strings=True).fields
    except (OSError, ValueError):
        return None
    template = fields.get("tokenizer.chat_template")
    if not isinstance(template, str):
        return None
    tokens = fields.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else []

    def text(key: str) -> str:
        token_id = fields.get(key)
        return str(tokens[token_id]) if isinstance(token_id, int) and token_id < len(tokens) else ""

    adds = bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bool(
        text("tokenizer.ggml.bos_token_id")
    )
    return ChatTemplate(
        template,
        text("tokenizer.ggml.bos_token_id"),
        text("tokenizer.ggml.eos_token_id"),
        adds_bos=adds,
    )

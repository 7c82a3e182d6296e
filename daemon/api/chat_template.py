"""Chat messages to a prompt, with the target model's own chat template.

The template comes from the model folder's ``tokenizer_config.json`` (``chat_template``) or,
failing that, the GGUF file's ``tokenizer.chat_template``; it is rendered in Jinja's sandbox,
with the variables Hugging Face templates expect. Models mark the end of an assistant turn
with a special token that is not always their EOS; the markers a template uses become
implicit stop strings, so a chat answer ends with its turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hetspec.protocol.gguf_header import read_gguf_header
from hetspec.protocol.tokenizer_files import END_OF_TURN_TEXTS, adds_bos, special_token_text

# end-of-turn markers of common template families (ChatML, Llama 3, Phi, Gemma; Llama 2's </s>)
TURN_ENDS = (*END_OF_TURN_TEXTS, "</s>")


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


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: str
    content: str | list[ContentPart]
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ("system", "user", "assistant", "developer"):
            raise ValueError(
                f"role must be system, user, assistant or developer, not {self.role!r}"
            )

    @property
    def text(self) -> str:
        """The content as one text: a list of text parts joined as given."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


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

    def render(self, messages: list[ChatMessage]) -> str:
        """The prompt for these messages, ending where the assistant's answer begins."""
        plain = [{"role": m.role, "content": m.text} for m in messages]
        try:
            prompt = self._template.render(
                messages=plain,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
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

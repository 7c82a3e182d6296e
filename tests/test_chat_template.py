"""Chat templates: from the model folder or its GGUF, rendered in the sandbox, clear errors."""

from __future__ import annotations

import json

import pytest

from hetspec.daemon.api.chat_template import (
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
)
from hetspec.daemon.config import BUNDLED_MODELS

TARGET = BUNDLED_MODELS / "target"


def test_the_bundled_template_renders_chatml_and_ends_turns_with_a_stop() -> None:
    template = load_chat_template(TARGET)
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="hi"),
    ]
    assert template.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.stops == ["<|im_end|>"]


def test_a_folder_without_a_template_falls_back_to_the_gguf(tmp_path) -> None:
    config = json.loads((TARGET / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path) is None
    from_gguf = load_chat_template(tmp_path, TARGET / "target-q8_0.gguf")
    assert from_gguf.source == load_chat_template(TARGET).source


def test_template_failures_are_clear_errors_and_the_sandbox_holds() -> None:
    strict = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception("
        "'the first message must be the user') }}{% endif %}ok"
    )
    with pytest.raises(ChatTemplateError, match="the first message must be the user"):
        strict.render([ChatMessage(role="system", content="x")])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}")
    sneaky = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="failed"):
        sneaky.render([ChatMessage(role="user", content="x")])
    with pytest.raises(ValueError, match="role must be"):
        ChatMessage(role="wizard", content="x")

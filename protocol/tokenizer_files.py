"""What a Hugging Face folder's tokenizer files say, read one way by every side.

The daemon (chat templates), the torch worker (tokenizing) and the GGUF exporter must agree
on whether the model's tokenizer puts BOS before a prompt: llama.cpp's ``add_bos_token`` of
the same model says so explicitly, a folder either in ``tokenizer_config.json`` or, as
Llama 3's does, only through ``tokenizer.json``'s post-processor template.
"""

from __future__ import annotations

import re
from typing import Any

# Token texts that end a turn, and with it generation, wherever a vocabulary has them
# (llama.cpp counts the same ones in its end-of-generation set)
END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def is_byte_level(spec: dict[str, Any]) -> bool:
    """Whether tokenizer.json pre-tokenizes byte-level (GPT-2's spelling of bytes): a
    ByteLevel pre-tokenizer, alone or in a Sequence (SmolLM's splits digits first)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return any((step or {}).get("type") == "ByteLevel" for step in steps)


def byte_level_pre_name(spec: dict[str, Any]) -> str | None:
    """llama.cpp's name (``tokenizer.ggml.pre``) of a byte-level pre-tokenizer it reproduces:
    "gpt-2" for ByteLevel alone, "smollm" for single digits first; None for others."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    kinds = [(step or {}).get("type") for step in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    return None


def is_sentencepiece_bpe(spec: dict[str, Any]) -> bool:
    """Whether tokenizer.json is transformers' conversion of a SentencePiece model (Llama 2's,
    Gemma's): a BPE whose missing characters fall back to ``<0xNN>`` byte pieces, with no
    byte-level pre-tokenizer; llama.cpp calls such a vocabulary "spm"."""
    model = spec.get("model") or {}
    return (
        model.get("type") == "BPE" and bool(model.get("byte_fallback")) and not is_byte_level(spec)
    )


def byte_piece(text: str) -> int | None:
    """The byte a ``<0xNN>`` piece stands for, or None for any other piece."""
    match = _BYTE_PIECE.fullmatch(text)
    return None if match is None else int(match.group(1), 16)


def special_token_text(settings: dict[str, Any], name: str) -> str:
    """A special token's text from tokenizer_config.json (a string, or an AddedToken dict)."""
    value = settings.get(name)
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def adds_bos(settings: dict[str, Any], spec: dict[str, Any] | None) -> bool:
    """Whether tokenizing a prompt (with special tokens) starts it with BOS: tokenizer_config's
    ``add_bos_token`` where given, else whether tokenizer.json's post-processor template
    begins with the BOS token."""
    if "add_bos_token" in settings:
        return bool(settings["add_bos_token"])
    bos = special_token_text(settings, "bos_token")
    if not bos or not spec:
        return False
    return _template_starts_with(spec.get("post_processor"), bos)


def generation_end_ids(generation: dict[str, Any]) -> list[int]:
    """generation_config.json's ``eos_token_id``: one id or a list (Gemma's instruction
    models list <eos> and <end_of_turn>)."""
    value = generation.get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _template_starts_with(processor: Any, token: str) -> bool:
    if not isinstance(processor, dict):
        return False
    if processor.get("type") == "Sequence":
        return any(_template_starts_with(p, token) for p in processor.get("processors", []))
    if processor.get("type") != "TemplateProcessing":
        return False
    single = processor.get("single") or []
    first = single[0] if single else {}
    return isinstance(first, dict) and (first.get("SpecialToken") or {}).get("id") == token

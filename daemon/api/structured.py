"""Structured output as each API asks for it, read into one ``Grammar``.

OpenAI: ``response_format`` ``{"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict", "description"}}``. Ollama: ``format``, ``"json"`` or a JSON
schema. Both APIs also take hetspec's own ``grammar`` (``{"type": "regex" | "lark" | "gbnf" |
"json_schema" | "json", "value": ...}``), but not beside the API's own field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from hetspec.speculative.constrain.grammars import Grammar


class FieldGrammar(Grammar, frozen=True):
    """A grammar an API's own field asked for (its errors name that field)."""

    source: str = "grammar"

    @property
    def field(self) -> str:
        return self.source


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = "answer"
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None  # every schema is enforced: strict or not, the same
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


def openai_grammar(response_format: ResponseFormat | None, grammar: Grammar | None):
    """The grammar an OpenAI request asks for (None: free text); ValueError naming the
    field where it is wrong."""
    if response_format is None or response_format.type == "text":
        return grammar
    if grammar is not None:
        raise ValueError("send either response_format or grammar, not both")
    if response_format.type == "json_object":
        return FieldGrammar("json", source="response_format")
    if response_format.type == "json_schema":
        given = response_format.json_schema
        if given is None:
            raise ValueError("response_format json_schema needs its json_schema object")
        if given.schema is None:
            return FieldGrammar("json", source="response_format")
        return FieldGrammar("json_schema", given.schema, source="response_format")
    raise ValueError(
        f"response_format type must be text, json_object or json_schema, not "
        f"{response_format.type!r}"
    )


def ollama_grammar(format_: Any, grammar: Grammar | None) -> Grammar | None:
    """The grammar an Ollama request's ``format`` asks for (None or "": free text)."""
    if format_ in (None, ""):
        return grammar
    if grammar is not None:
        raise ValueError("send either format or grammar, not both")
    if format_ == "json":
        return FieldGrammar("json", source="format")
    if isinstance(format_, dict):
        return FieldGrammar("json_schema", format_, source="format")
    raise ValueError(f'format must be "json" or a JSON schema object, not {format_!r}')

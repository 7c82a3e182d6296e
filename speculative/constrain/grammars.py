"""What a request may constrain its output with, compiled and checked before it decodes.

Kinds: ``json_schema`` (a JSON schema, as an object or its text), ``json`` (any JSON object),
``regex`` (the whole output matches it), ``lark`` (llguidance's Lark dialect) and ``gbnf``
(llama.cpp's grammar format, translated to Lark). A grammar that does not compile, is larger
than ``MAX_GRAMMAR_CHARS`` or exceeds the parser's limits is a ``GrammarError`` naming the
problem.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import msgspec
from llguidance.gbnf_to_lark import gbnf_to_lark

KINDS = ("json_schema", "json", "regex", "lark", "gbnf")
MAX_GRAMMAR_CHARS = 256 * 1024
# JSON on one line with the separators models write most (Python's json.dumps layout): a
# model forced to compact JSON leaves its own tokenization of ": "; free whitespace would
# leave nothing forced (a newline may follow any brace), so no key or separator is known
# before the target says it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot be used; the message names the problem."""


class Grammar(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What a request constrains its output with: ``type`` one of ``KINDS``, ``value`` the
    schema (an object or its text), the regular expression or the grammar's text (none for
    ``json``)."""

    type: str
    value: Any = None

    @property
    def field(self) -> str:
        """The request's field it came from, for its errors."""
        return "grammar"

    def text(self) -> str:
        """The llguidance grammar (``GrammarError`` where it cannot be made)."""
        return grammar_text(self.type, self.value)


def parser_limits() -> llguidance.LLParserLimits:
    """Bounds on the parser's work per mask and on the grammar's size, so that an enormous
    or pathological grammar errs instead of stalling the daemon."""
    return llguidance.LLParserLimits(max_grammar_size=200_000, step_lexer_fuel=200_000)


def grammar_text(kind: str, source: Any) -> str:
    """The llguidance grammar for ``source`` of ``kind`` (not yet checked against a
    vocabulary: see ``check``)."""
    if kind not in KINDS:
        raise GrammarError(f"grammar type must be one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "json":
        source = {"type": "object"}
        kind = "json_schema"
    if kind == "json_schema":
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except json.JSONDecodeError as error:
                raise GrammarError(f"the JSON schema is not JSON: {error}") from None
        if not isinstance(source, dict):
            raise GrammarError("a JSON schema must be an object")
        text = json.dumps(source)
        _bounded(text)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as error:
            raise GrammarError(f"invalid JSON schema: {error}") from None
    if not isinstance(source, str) or not source:
        raise GrammarError(f"a {kind} grammar must be a non-empty string")
    _bounded(source)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "gbnf":
        try:
            source = gbnf_to_lark(source)
        except Exception as error:  # the translator raises plain exceptions on bad input
            raise GrammarError(f"invalid GBNF grammar: {error}") from None
    return llguidance.LLMatcher.grammar_from_lark(source)


def check(grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
    """Raise ``GrammarError`` unless ``grammar`` compiles for ``tokenizer`` within the
    parser's limits. Drops the GIL while it compiles (run it in a thread to bound its time)."""
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=parser_limits())
    if error:
        raise GrammarError(f"the grammar does not compile: {_first_line(error)}")


def _bounded(text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(
            f"the grammar has {len(text):,} characters; at most {MAX_GRAMMAR_CHARS:,} are taken"
        )


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line[:500]

"""Verified tokens as the text a request streams: UTF-8 kept whole, stop strings held back."""

from __future__ import annotations

import codecs
from collections.abc import Iterable


class Detokenizer:
    """Token ids to text, piece by piece, never splitting a UTF-8 character across pieces."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self._bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._decoder.decode(self._bytes[token])

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class TextOutput:
    """A request's verified tokens as the text it streams: detokenized piece by piece, with
    text that could begin a stop string held back until it is known not to; at a stop string
    the text ends just before it and ``stopped`` is set (the token that completed it is the
    last one generated)."""

    def __init__(
        self, token_bytes: list[bytes], stops: list[str], special: Iterable[int] = ()
    ) -> None:
        self._detokenizer = Detokenizer(token_bytes)
        self._bytes = token_bytes
        self._stops = [stop for stop in stops if stop]
        self._special = frozenset(special)
        self._held = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """The text that may be sent now that ``token`` was generated. A control token is
        markup, never text: one that is a stop string (a chat turn's end) stops the text
        there, any other renders as nothing."""
        if token not in self._special:
            return self._release(self._detokenizer.add(token))
        if self._bytes[token].decode(errors="replace") in self._stops:
            text, self._held = self._held + self._detokenizer.flush(), ""
            self.stopped = True
            return text
        return ""

    def flush(self) -> str:
        """What is left at the end of generation (nothing after a stop string)."""
        if self.stopped:
            return ""
        text, self._held = self._held + self._detokenizer.flush(), ""
        return text

    def _release(self, piece: str) -> str:
        text = self._held + piece
        found = [(text.find(stop), stop) for stop in self._stops if stop in text]
        if found:
            self.stopped, self._held = True, ""
            return text[: min(at for at, _ in found)]
        keep = max(
            (n for stop in self._stops for n in range(1, len(stop)) if text.endswith(stop[:n])),
            default=0,
        )
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

"""What both clients share: where the daemon is, typed results and errors, the wire formats."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

DEFAULT_SOCKET = "/run/hetspec/hetspecd.sock"


class HetspecError(Exception):
    """Base of every error the client library raises."""


class DaemonUnreachable(HetspecError):
    """Nothing answers at the address (the daemon is not running, or the socket is not
    accessible); the message says which address and why."""


class ApiError(HetspecError):
    """The daemon answered with an error: ``status`` and its message."""

    def __init__(
        self, status: int, message: str, kind: str = "", retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.retry_after_s = (
            status,
            message,
            kind,
            retry_after_s,
        )


class BadRequest(ApiError):
    """4xx: the request needs fixing; the message says what."""


class QueueFull(ApiError):
    """429: other requests fill the queue; retry after ``retry_after_s``."""


class Unavailable(ApiError):
    """503: the daemon is loading, restarting a worker or shutting down."""


class GenerationFailed(HetspecError):
    """A streamed generation ended with an error after some text had arrived."""


@dataclass(frozen=True)
class Address:
    base_url: str
    socket: str | None  # a Unix socket path, or None for TCP

    def __str__(self) -> str:
        return f"unix://{self.socket}" if self.socket else self.base_url


def resolve_address(host: str | None = None) -> Address:
    """``host``, else ``$HETSPEC_HOST``, else the default socket. Forms: ``unix:///path``,
    a bare ``/path``, or ``http://host:port``."""
    source = "the host" if host else "HETSPEC_HOST"
    host = host or os.environ.get("HETSPEC_HOST") or f"unix://{DEFAULT_SOCKET}"
    if host.startswith("unix://"):
        return Address("http://hetspecd", host.removeprefix("unix://"))
    if host.startswith("/"):
        return Address("http://hetspecd", host)
    if host.startswith(("http://", "https://")):
        return Address(host.rstrip("/"), None)
    raise ValueError(f"{source} must be unix:///path or http://host:port, not {host!r}")


@dataclass(frozen=True)
class Completion:
    """A finished generation: the text, the token ids and the daemon's statistics."""

    text: str
    tokens: list[int]
    done_reason: str  # "stop" (EOS or a stop string), "length", or "error"
    mode: str
    timings: dict  # llama.cpp names: prompt_n, predicted_n, predicted_per_second, ...
    speculative: dict | None = None  # rounds, mean accepted length, gamma history, ...
    devices: dict = field(default_factory=dict)
    id: str = ""

    @classmethod
    def from_final(cls, final: dict, text: str) -> Completion:
        return cls(
            text=text,
            tokens=final.get("tokens", []),
            done_reason=final["done_reason"],
            mode=final.get("mode", ""),
            timings=final.get("timings", {}),
            speculative=final.get("speculative"),
            devices=final.get("devices", {}),
            id=final.get("id", ""),
        )


def error_from(status: int, body: bytes, retry_after: str | None) -> ApiError:
    try:
        error = json.loads(body)["error"]
        if isinstance(error, str):  # Ollama's shape (/api/...): the message alone
            error = {"message": error}
        message, kind = error["message"], error.get("type", "")
    except (ValueError, KeyError, TypeError):
        message, kind = body.decode(errors="replace").strip() or f"HTTP {status}", ""
    retry = float(retry_after) if retry_after and retry_after.isdigit() else None
    kind_class = {429: QueueFull, 503: Unavailable}.get(status)
    if kind_class is None:
        kind_class = BadRequest if 400 <= status < 500 else ApiError
    return kind_class(status, message, kind, retry)


# the client's names for Ollama's sampling options; the rest are hetspec's top-level extensions
_OLLAMA_OPTIONS = {
    "max_tokens": "num_predict",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
}


def generate_body(prompt: str, options: dict, stream: bool) -> dict:
    """The /api/generate body (Ollama's, the prompt continued as given); options left None
    are left to the daemon's defaults."""
    given = {k: v for k, v in options.items() if v is not None}
    sampling = {_OLLAMA_OPTIONS[k]: given.pop(k) for k in list(given) if k in _OLLAMA_OPTIONS}
    return {"prompt": prompt, "raw": True, "options": sampling, **given, "stream": stream}


def chat_body(messages: list[dict], options: dict, stream: bool) -> dict:
    body = {"messages": messages, **{k: v for k, v in options.items() if v is not None}}
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class StreamParser:
    """Turns the lines of a native NDJSON or an OpenAI SSE stream into text pieces and, at
    the end, a ``Completion``."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.pieces: list[str] = []
        self.completion: Completion | None = None
        self._reason = "length"

    def feed(self, line: str) -> str | None:
        """The text piece this line carries, if any; raises ``GenerationFailed``."""
        line = line.strip()
        if not line:
            return None
        if self.sse:
            if not line.startswith("data: ") or line == "data: [DONE]":
                return None
            document = json.loads(line.removeprefix("data: "))
            if "error" in document:
                raise GenerationFailed(document["error"]["message"])
            return self._chat_chunk(document)
        document = json.loads(line)
        if document.get("done"):
            self.completion = Completion.from_final(document, "".join(self.pieces))
            if document.get("done_reason") == "error":
                raise GenerationFailed(str(document.get("error", "unknown")))
            return None
        self.pieces.append(document["response"])
        return document["response"]

    def _chat_chunk(self, chunk: dict) -> str | None:
        if chunk.get("usage") is not None:  # the last chunk: usage and our statistics
            timings = chunk.get("timings", {})
            self.completion = Completion(
                text="".join(self.pieces),
                tokens=chunk.get("tokens", []),
                done_reason=self._reason,
                mode=chunk.get("mode", ""),
                timings=timings,
                speculative=chunk.get("speculative"),
                devices=chunk.get("devices", {}),
                id=chunk.get("id", ""),
            )
            return None
        for choice in chunk.get("choices", []):
            if choice.get("finish_reason"):
                self._reason = choice["finish_reason"]
            text = choice.get("delta", {}).get("content")
            if text:
                self.pieces.append(text)
                return text
        return None

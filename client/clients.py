"""The client library: ``Client`` (blocking) and ``AsyncClient`` (asyncio), same methods.

    from hetspec.client import Client
    client = Client()                       # $HETSPEC_HOST or /run/hetspec/hetspecd.sock
    print(client.generate("def read(path):", max_tokens=64).text)
    with client.stream("def read(path):") as answer:
        for piece in answer:
            print(piece, end="", flush=True)
    print(answer.completion.timings["predicted_per_second"])

Options: ``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop`` (Ollama's
``options`` of /api/generate) and hetspec's ``mode``, ``gamma``, ``ignore_eos``; the prompt is
continued as given (``raw``). ``chat`` and ``chat_stream`` speak /v1/chat/completions.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator

import httpx

from hetspec.client.types import (
    DEFAULT_SOCKET,
    Address,
    Completion,
    DaemonUnreachable,
    StreamParser,
    Unavailable,
    chat_body,
    error_from,
    generate_body,
    resolve_address,
)


def _headers(token: str | None) -> dict[str, str]:
    token = token or os.environ.get("HETSPEC_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def _unreachable(address: Address, error: Exception) -> DaemonUnreachable:
    cause = error.__cause__ or error.__context__ or error
    reason = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
    hint = ""
    if address.socket and "ermission" in reason:
        hint = " (add yourself to the socket's group, e.g. `sudo usermod -aG hetspec $USER`)"
    elif address.socket and ("No such file" in reason or "refused" in reason):
        if address.socket == DEFAULT_SOCKET:  # the systemd unit's
            hint = " (is hetspecd running? `systemctl status hetspecd`)"
        else:
            hint = f" (is hetspecd running with `--socket {address.socket}`?)"
    return DaemonUnreachable(f"cannot reach hetspecd at {address}: {reason}{hint}")


def _is_error(path: str, status: int) -> bool:
    """An error status; /health's 503 (loading, draining) is an answer, not an error."""
    return status >= 400 and not (path == "/health" and status == 503)


def _chat_completion(document: dict) -> Completion:
    choice = document["choices"][0]
    return Completion(
        text=choice["message"]["content"],
        tokens=document.get("tokens", []),
        done_reason=choice["finish_reason"],
        mode=document.get("mode", ""),
        timings=document.get("timings", {}),
        speculative=document.get("speculative"),
        id=document["id"],
        devices=document.get("devices", {}),
    )


class Stream:
    """A streamed generation: iterate for text pieces; ``completion`` once it has ended."""

    def __init__(self, lines: Iterator[str], parser: StreamParser, close) -> None:
        self._lines, self._parser, self._close = lines, parser, close

    @property
    def completion(self) -> Completion | None:
        return self._parser.completion

    def __iter__(self) -> Iterator[str]:
        try:
            for line in self._lines:
                piece = self._parser.feed(line)
                if piece:
                    yield piece
        finally:
            self.close()

    def close(self) -> None:
        self._close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client:
    def __init__(
        self, host: str | None = None, token: str | None = None, timeout_s: float = 600.0
    ) -> None:
        self.address = resolve_address(host)
        transport = httpx.HTTPTransport(uds=self.address.socket) if self.address.socket else None
        self._http = httpx.Client(
            base_url=self.address.base_url,
            transport=transport,
            headers=_headers(token),
            timeout=timeout_s,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(
        self, method: str, path: str, body: dict | None = None, stream: bool = False
    ) -> httpx.Response:
        request = self._http.build_request(method, path, json=body)
        try:
            response = self._http.send(request, stream=stream)
        except httpx.TransportError as error:
            raise _unreachable(self.address, error) from None
        if _is_error(path, response.status_code):
            content = response.read()
            response.close()
            raise error_from(response.status_code, content, response.headers.get("Retry-After"))
        return response

    def health(self) -> dict:
        """/health: ``status`` is "ready", "loading" or "draining"."""
        return self._send("GET", "/health").json()

    def wait_ready(self, timeout_s: float) -> dict:
        """Poll /health until the workers are ready; ``Unavailable`` after ``timeout_s``."""
        deadline, last = time.monotonic() + timeout_s, "no answer yet"
        while time.monotonic() < deadline:
            try:
                health = self.health()
                if health["status"] == "ready":
                    return health
                last = f"status {health['status']}"
            except DaemonUnreachable as error:
                last = str(error)
            time.sleep(0.2)
        raise Unavailable(503, f"hetspecd was not ready within {timeout_s:g} s ({last})")

    def props(self) -> dict:
        return self._send("GET", "/props").json()

    def models(self) -> list[str]:
        return [model["id"] for model in self._send("GET", "/v1/models").json()["data"]]

    def metrics(self) -> str:
        return self._send("GET", "/metrics").text

    def generate(self, prompt: str, **options) -> Completion:
        """One generation, returned whole."""
        final = self._send("POST", "/api/generate", generate_body(prompt, options, False)).json()
        return Completion.from_final(final, final["response"])

    def stream(self, prompt: str, **options) -> Stream:
        """One generation, streamed piece by piece as the daemon verifies it."""
        response = self._send("POST", "/api/generate", generate_body(prompt, options, True), True)
        return Stream(response.iter_lines(), StreamParser(sse=False), response.close)

    def chat(self, messages: list[dict], **options) -> Completion:
        """One chat answer (/v1/chat/completions, the model's chat template)."""
        body = chat_body(messages, options, False)
        return _chat_completion(self._send("POST", "/v1/chat/completions", body).json())

    def chat_stream(self, messages: list[dict], **options) -> Stream:
        body = chat_body(messages, options, True)
        response = self._send("POST", "/v1/chat/completions", body, True)
        return Stream(response.iter_lines(), StreamParser(sse=True), response.close)


class AsyncStream:
    def __init__(self, lines: AsyncIterator[str], parser: StreamParser, close) -> None:
        self._lines, self._parser, self._close = lines, parser, close

    @property
    def completion(self) -> Completion | None:
        return self._parser.completion

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for line in self._lines:
                piece = self._parser.feed(line)
                if piece:
                    yield piece
        finally:
            await self.close()

    async def close(self) -> None:
        await self._close()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncClient:
    def __init__(
        self, host: str | None = None, token: str | None = None, timeout_s: float = 600.0
    ) -> None:
        self.address = resolve_address(host)
        socket = self.address.socket
        transport = httpx.AsyncHTTPTransport(uds=socket) if socket else None
        self._http = httpx.AsyncClient(
            base_url=self.address.base_url,
            transport=transport,
            headers=_headers(token),
            timeout=timeout_s,
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _send(
        self, method: str, path: str, body: dict | None = None, stream: bool = False
    ) -> httpx.Response:
        request = self._http.build_request(method, path, json=body)
        try:
            response = await self._http.send(request, stream=stream)
        except httpx.TransportError as error:
            raise _unreachable(self.address, error) from None
        if _is_error(path, response.status_code):
            content = await response.aread()
            await response.aclose()
            raise error_from(response.status_code, content, response.headers.get("Retry-After"))
        return response

    async def health(self) -> dict:
        return (await self._send("GET", "/health")).json()

    async def props(self) -> dict:
        return (await self._send("GET", "/props")).json()

    async def generate(self, prompt: str, **options) -> Completion:
        body = generate_body(prompt, options, False)
        final = (await self._send("POST", "/api/generate", body)).json()
        return Completion.from_final(final, final["response"])

    async def stream(self, prompt: str, **options) -> AsyncStream:
        body = generate_body(prompt, options, True)
        response = await self._send("POST", "/api/generate", body, True)
        return AsyncStream(response.aiter_lines(), StreamParser(sse=False), response.aclose)

    async def chat(self, messages: list[dict], **options) -> Completion:
        body = chat_body(messages, options, False)
        return _chat_completion((await self._send("POST", "/v1/chat/completions", body)).json())

    async def chat_stream(self, messages: list[dict], **options) -> AsyncStream:
        body = chat_body(messages, options, True)
        response = await self._send("POST", "/v1/chat/completions", body, True)
        return AsyncStream(response.aiter_lines(), StreamParser(sse=True), response.aclose)


__all__ = ["AsyncClient", "AsyncStream", "Client", "Stream"]

"""A blocking HTTP client for hetspecd's Unix socket (the standard library is enough).

The full client library (async, OpenAI-style endpoints) grows on top of this; today it speaks
the two endpoints the daemon serves: ``GET /health`` and ``POST /api/generate``.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

DEFAULT_SOCKET = Path("/run/hetspec/hetspecd.sock")


class ClientError(RuntimeError):
    """The daemon could not be reached or refused the request; the message says why."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        try:
            self.sock.connect(self._path)
        except OSError as error:
            self.sock.close()
            raise ClientError(f"cannot reach hetspecd at {self._path}: {error.strerror}") from None


class Client:
    def __init__(self, socket_path: str | Path = DEFAULT_SOCKET, timeout: float = 600) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout

    def _request(self, method: str, path: str, body: dict | None = None):
        connection = _UnixConnection(self.socket_path, self.timeout)
        payload = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, payload, {"Content-Type": "application/json"})
        return connection, connection.getresponse()

    def health(self) -> tuple[int, dict]:
        connection, response = self._request("GET", "/health")
        try:
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    def wait_ready(self, timeout_s: float) -> dict:
        """Poll /health until the workers are ready; ``ClientError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        last = "the socket does not exist yet"
        while time.monotonic() < deadline:
            try:
                status, body = self.health()
                if status == 200:
                    return body
                last = f"status {body.get('status')}"
            except ClientError as error:
                last = str(error)
            time.sleep(0.2)
        raise ClientError(f"hetspecd was not ready within {timeout_s:g} s ({last})")

    def complete(self, prompt: str, **options: object) -> dict:
        """One generation, not streamed: the final object with the whole text in ``response``."""
        connection, response = self._request(
            "POST", "/api/generate", {"prompt": prompt, **options, "stream": False}
        )
        try:
            body = json.loads(response.read())
        finally:
            connection.close()
        if response.status != 200:
            raise ClientError(body.get("error", f"HTTP {response.status}"))
        return body

    def generate(self, prompt: str, **options: object) -> Iterator[dict]:
        """Stream the NDJSON objects of one generation: pieces, then the final statistics."""
        connection, response = self._request(
            "POST", "/api/generate", {"prompt": prompt, **options, "stream": True}
        )
        try:
            if response.status != 200:
                try:
                    message = json.loads(response.read())["error"]
                except (ValueError, KeyError):
                    message = f"HTTP {response.status}"
                raise ClientError(message)
            for line in iter(response.readline, b""):
                yield json.loads(line)
        finally:
            connection.close()

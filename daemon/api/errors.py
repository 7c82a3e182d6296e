"""Errors as the HTTP API returns them, with a message that says what to fix.

Every failure a client can cause is an ``ApiError`` (4xx); the middleware turns it, and
aiohttp's own 404/405/413, into OpenAI's ``{"error": {"message", "type", "code"}}``, or
Ollama's ``{"error": "message"}`` under ``/api/`` (Ollama's clients read that). Anything else
that escapes a handler is a bug of ours: logged with its traceback and answered 500.
"""

from __future__ import annotations

import msgspec
import structlog
from aiohttp import web

log = structlog.get_logger("hetspec.daemon.api")

KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "queue_full",
    501: "not_implemented_error",
    503: "unavailable",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        kind = KINDS.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "code": self.status}}

    def response(self, ollama: bool = False) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return web.Response(
            status=self.status,
            body=msgspec.json.encode({"error": self.message} if ollama else self.body()),
            content_type="application/json",
            headers=headers,
        )


def decode(raw: bytes, kind: type):
    """A request body as ``kind``, or a 400 that names the field and the problem."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as error:  # also what __post_init__ raised
        raise ApiError(400, f"invalid request: {error}") from None
    except msgspec.DecodeError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    except UnicodeDecodeError as error:  # msgspec checks UTF-8 only where it decodes strings
        raise ApiError(
            400, f"the request body is not valid UTF-8: {error.reason} at byte {error.start}"
        ) from None


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    ollama = request.path.startswith("/api/")
    try:
        return await handler(request)
    except ApiError as error:
        return error.response(ollama)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = {
            404: f"no endpoint {request.path}",
            405: f"{request.method} is not allowed on {request.path}",
            413: "the request body is too large",
        }.get(error.status, error.reason)
        return ApiError(error.status, message).response(ollama)
    except Exception:
        log.exception("unhandled error", path=request.path)
        return ApiError(500, "internal error in hetspecd; see its log").response(ollama)

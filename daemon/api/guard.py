"""What keeps the HTTP server's resources bounded whoever connects: a connection limit, an
idle timeout, and malformed requests answered without a log line at error level.

aiohttp's defaults keep an idle connection for about an hour and accept any number of them:
987 idle connections from one local user reached the 1,024 descriptor limit, and every new
client (and a worker restart) failed. Here a connection over ``max_connections`` is answered
503 and closed at once, and one without a complete request within ``idle_timeout_s`` is closed
(aiohttp's keep-alive timer runs from the connection's start and from each response until the
next request's headers are complete, so it bounds slow headers too).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
from collections.abc import Callable
from typing import Any, cast

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = structlog.get_logger("hetspec.daemon.http")

RESERVED_FDS = 256  # besides HTTP connections: ZeroMQ sockets, model files, the arena, logs

REFUSAL_BODY = (
    b'{"error": {"message": "hetspecd has too many open connections; retry later", '
    b'"type": "unavailable", "code": 503}}'
)
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
    + str(len(REFUSAL_BODY)).encode()
    + b"\r\n\r\n"
    + REFUSAL_BODY
)


class GuardedRunner(web.AppRunner):
    """An ``AppRunner`` whose sites accept at most ``max_connections`` open connections (all
    sites together) and close idle ones after ``idle_timeout_s``; ``on_refused`` is called for
    each connection refused. Malformed requests are logged at debug level (:class:`ServerLog`).
    """

    def __init__(
        self,
        app: web.Application,
        *,
        max_connections: int,
        idle_timeout_s: float,
        on_refused: Callable[[], None],
        **kwargs: Any,
    ) -> None:
        logger = ServerLog(logging.getLogger("aiohttp.server"))
        super().__init__(app, keepalive_timeout=idle_timeout_s, logger=logger, **kwargs)
        self._limit = max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if problem := descriptor_shortfall(max_connections, soft):
            log.warning(problem)
        self._on_refused = on_refused
        self._guard: _ConnectionLimit | None = None

    @property
    def server(self) -> Any:
        """The protocol factory the sites serve with (aiohttp's sites take it from here): the
        low-level server behind the connection limit."""
        server = super().server
        if server is None:
            return None
        if self._guard is None or self._guard.server is not server:
            self._guard = _ConnectionLimit(server, self._limit, self._on_refused)
        return self._guard


def descriptor_shortfall(max_connections: int, soft_limit: int) -> str | None:
    """Why ``max_connections`` open connections could exhaust the process's descriptors
    (``soft_limit``, RLIMIT_NOFILE), or None where there is room."""
    if soft_limit == resource.RLIM_INFINITY or soft_limit >= max_connections + RESERVED_FDS:
        return None
    return (
        f"http_max_connections ({max_connections}) leaves too few of the {soft_limit} file "
        f"descriptors allowed (ulimit -n, LimitNOFILE) for the workers: keep it below "
        f"{max(soft_limit - RESERVED_FDS, 0)} or raise the limit"
    )


class _ConnectionLimit:
    def __init__(self, server: web.Server, limit: int, on_refused: Callable[[], None]) -> None:
        self.server = server
        self.limit = limit
        self.on_refused = on_refused

    def __call__(self) -> asyncio.BaseProtocol:
        # (closed connections stay counted until their handler task has ended)
        if len(self.server.connections) >= self.limit:
            self.on_refused()
            return _Refuse()
        return self.server()


class _Refuse(asyncio.Protocol):
    """Answers 503 and closes: the client learns why, and the descriptor is freed at once
    (a client that has already sent its request may see a reset instead: its bytes are not
    read, and waiting for them would hold the descriptor again)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.WriteTransport, transport)  # (uvloop's are not registered as one)
        stream.write(REFUSAL)
        stream.close()


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger, but a malformed request (answered 400 by aiohttp) is one debug
    line naming the kind of error: any client can send them, and neither its traceback nor its
    bytes (which may hold a header's value) belong in the journal. Other errors pass as they
    are."""

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        error = _error_of(kwargs.get("exc_info"))
        if isinstance(error, HttpProcessingError):
            self.logger.debug("refused a malformed HTTP request (%s)", type(error).__name__)
            return
        super().log(level, msg, *args, **kwargs)


def _error_of(exc_info: object) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple):
        return exc_info[1]
    return sys.exc_info()[1] if exc_info else None

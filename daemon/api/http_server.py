"""hetspecd's HTTP server: where it listens, who may ask, and what every response counts.

Contract: ``HttpServer.listen`` serves the routes of every API (the native status endpoints,
Ollama's and OpenAI's) on the sockets systemd passed, or else on the configured Unix socket:
claimed first (a second daemon serving there is refused), a stale file of a dead instance
removed, created mode 0660 before it listens. Where ``tcp.listen`` is set it serves over TCP
too, and there every request must carry the configured bearer token (401 otherwise; the web
page's static files excepted: web_page.py); the Unix socket's file permissions are its access
control. Bodies over ``MAX_BODY_BYTES`` are refused, connections beyond
``http_max_connections`` refused and counted, and every response is counted by endpoint and
status. ``runner`` and ``own_socket`` say what it got so far, however far it got, for the
service to release when it stops.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from hetspec.daemon.api.errors import ApiError, json_errors
from hetspec.daemon.api.guard import GuardedRunner
from hetspec.daemon.api.ollama import OllamaApi
from hetspec.daemon.api.openai import openai_routes
from hetspec.daemon.api.status import native_routes
from hetspec.daemon.api.web_page import WebPage, is_public

if TYPE_CHECKING:
    from hetspec.daemon.service import Service

log = structlog.get_logger("hetspec.daemon")

MAX_BODY_BYTES = 4 << 20


class HttpServer:
    """The HTTP side of ``service``."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.runner: web.AppRunner | None = None
        self.own_socket: Path | None = None  # the socket file we created (not systemd's)

    async def listen(self, passed_sockets: Callable[[], list[socket.socket]]) -> None:
        """Serve every route: on the sockets ``passed_sockets()`` returns (systemd's), or on
        the configured Unix socket, created 0660 before it listens; and over TCP where
        configured."""
        service = self.service
        app = web.Application(
            middlewares=[json_errors, self._authorize], client_max_size=MAX_BODY_BYTES
        )
        page = WebPage()
        routes = [*native_routes(service), *OllamaApi(service).routes(), *openai_routes(service)]
        app.add_routes([*page.with_page_at_root(routes), *page.asset_routes()])
        app.on_response_prepare.append(self._count_response)
        self.runner = GuardedRunner(
            app,
            max_connections=service.config.http_max_connections,
            idle_timeout_s=service.config.http_idle_timeout_s,
            on_refused=self._refused_connection,
            handler_cancellation=True,
            access_log=None,
        )
        await self.runner.setup()
        passed = passed_sockets()
        if passed:  # socket activation: systemd owns the socket file and its permissions
            for listener in passed:
                await web.SockSite(self.runner, listener).start()
            log.info("listening on sockets passed by systemd", count=len(passed))
        else:
            path = Path(service.config.socket)
            path.parent.mkdir(parents=True, exist_ok=True)
            service.instance.claim_socket(path)  # refuses while another daemon serves there
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a stale socket of a dead instance; the lock says none is alive
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
            os.chmod(path, 0o660)  # before listening: never reachable with looser rights
            listener.listen(128)
            self.own_socket = path
            await web.SockSite(self.runner, listener).start()
        if service.config.tcp.listen:
            host, _, port = service.config.tcp.listen.rpartition(":")
            await web.TCPSite(self.runner, host.strip("[]") or None, int(port)).start()
            log.info("listening on TCP (bearer token required)", address=service.config.tcp.listen)

    @web.middleware
    async def _authorize(self, request: web.Request, handler) -> web.StreamResponse:
        """Requests over TCP must carry the configured bearer token, but for the web page's
        static files (which ask for the token); the Unix socket's file permissions are its
        access control."""
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if isinstance(peer, tuple) and not is_public(request):  # an IP peer: (host, port, ...)
            token = self.service.config.tcp.token or ""
            # as bytes, exactly as received: aiohttp decoded the header with surrogateescape,
            # and a token from argv may hold surrogates too (then any byte compares)
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            expected = f"Bearer {token}".encode("utf-8", "surrogateescape")
            if not token or not hmac.compare_digest(given, expected):
                raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer ...)")
        return await handler(request)

    def _refused_connection(self) -> None:
        self.service.metrics.connections_refused.inc()
        log.warning(
            "too many open HTTP connections; refusing new ones",
            limit=self.service.config.http_max_connections,
        )

    async def _count_response(self, request: web.Request, response: web.StreamResponse) -> None:
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        self.service.metrics.requests.labels(endpoint, str(response.status)).inc()

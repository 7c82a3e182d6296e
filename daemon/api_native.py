"""hetspec's own endpoints: ``/api/generate`` (NDJSON, Ollama-style), ``/health``, ``/props``,
``/metrics``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from hetspec.daemon.api_errors import ApiError, decode
from hetspec.daemon.metrics import CONTENT_TYPE_LATEST
from hetspec.daemon.requests import GenerateRequest
from hetspec.daemon.runs import collect, stream

if TYPE_CHECKING:
    from hetspec.daemon.service import Service


def _line(document: dict) -> bytes:
    return msgspec.json.encode(document) + b"\n"


def native_routes(service: Service) -> list[web.RouteDef]:
    async def health(request: web.Request) -> web.Response:
        document = service.health()
        return web.json_response(document, status=200 if document["status"] == "ready" else 503)

    async def props(request: web.Request) -> web.Response:
        return web.json_response(service.props())

    async def metrics(request: web.Request) -> web.Response:
        service.refresh_gauges()
        return web.Response(
            body=service.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def generate(request: web.Request) -> web.StreamResponse:
        body = decode(await request.read(), GenerateRequest)
        async with service.generation(body) as run:
            if not body.stream:
                text = await collect(run)
                return web.json_response({**run.final(), "response": text})

            def failure(error: ApiError) -> bytes:
                return _line({**run.final(), "done_reason": "error", **error.body()})

            return await stream(
                request,
                run,
                content_type="application/x-ndjson",
                encode_piece=lambda piece: _line({"response": piece, "done": False}),
                encode_end=lambda: _line(run.final()),
                encode_failure=failure,
            )

    return [
        web.get("/health", health),
        web.get("/props", props),
        web.get("/metrics", metrics),
        web.post("/api/generate", generate),
    ]

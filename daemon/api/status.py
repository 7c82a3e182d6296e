"""hetspec's status endpoints: ``/health``, ``/props``, ``/metrics`` (generation is Ollama's
API, in api_ollama)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from hetspec.daemon.metrics import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from hetspec.daemon.service import Service


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

    return [
        web.get("/health", health),
        web.get("/props", props),
        web.get("/metrics", metrics),
    ]

"""The web page: a chat with the served model beside live plots of what the daemon does.

Contract: ``with_page_at_root(routes)`` returns ``routes`` with ``GET /`` answering the page
(daemon/api/web/index.html) to a client whose ``Accept`` prefers HTML (a browser), and the
route's own answer (Ollama's "is running" line, which tools probe) to everyone else;
``asset_routes()`` serves the page's scripts and style under ``/web/``. The files are package
data, read once when the server starts. ``is_public(request)`` says which requests the TCP
listener serves without the bearer token: the page and its files, static and holding no data
of the daemon's (the page asks for the token and sends it on every API call it makes).
"""

from __future__ import annotations

import importlib.resources

from aiohttp import web

ASSET_PREFIX = "/web/"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
}
# The page's own files only: no inline script, no other origin (no CDN: the box may be offline).
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def prefers_html(accept: str) -> bool:
    """Whether an ``Accept`` header names HTML at a quality no lower than JSON's or plain
    text's: a browser's navigation, not curl's or a library's ``*/*``."""
    quality: dict[str, float] = {}
    for part in accept.split(","):
        media, *parameters = (piece.strip() for piece in part.split(";"))
        q = 1.0
        for parameter in parameters:
            name, _, value = parameter.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        media = media.lower()
        quality[media] = max(q, quality.get(media, 0.0))
    html = max(quality.get("text/html", 0.0), quality.get("application/xhtml+xml", 0.0))
    others = max(quality.get("application/json", 0.0), quality.get("text/plain", 0.0))
    return html > 0 and html >= others


def is_public(request: web.Request) -> bool:
    """The page and its files: served over TCP without the token (see the module's contract)."""
    if request.method not in ("GET", "HEAD"):
        return False
    if request.path.startswith(ASSET_PREFIX):
        return True
    return request.path == "/" and prefers_html(request.headers.get("Accept", ""))


def _read_assets() -> dict[str, web.Response]:
    folder = importlib.resources.files("hetspec.daemon.api") / "web"
    assets = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if suffix in CONTENT_TYPES:
            assets[entry.name] = (entry.read_bytes(), CONTENT_TYPES[suffix])
    return assets


class WebPage:
    """The page's files, read once; each request gets a fresh response of them."""

    def __init__(self) -> None:
        self.assets = _read_assets()
        if "index.html" not in self.assets:
            raise RuntimeError("hetspec's web page is missing from the package (web/index.html)")

    def _respond(self, name: str) -> web.Response:
        body, content_type = self.assets[name]
        return web.Response(body=body, headers={"Content-Type": content_type, **HEADERS})

    def with_page_at_root(self, routes: list[web.RouteDef]) -> list[web.RouteDef]:
        """``routes`` with their ``GET /`` serving the page to browsers (one is required)."""

        def wrap(route: web.RouteDef) -> web.RouteDef:
            if not (route.method == "GET" and route.path == "/"):
                return route
            others = route.handler

            async def root(request: web.Request) -> web.StreamResponse:
                if prefers_html(request.headers.get("Accept", "")):
                    return self._respond("index.html")
                return await others(request)

            return web.RouteDef(route.method, route.path, root, route.kwargs)

        wrapped = [wrap(route) for route in routes]
        if all(new is old for new, old in zip(wrapped, routes, strict=True)):
            raise ValueError("no GET / route to serve the page from")
        return wrapped

    def asset_routes(self) -> list[web.RouteDef]:
        async def asset(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            if name not in self.assets:
                raise web.HTTPNotFound()
            return self._respond(name)

        return [web.get(ASSET_PREFIX + "{name}", asset)]

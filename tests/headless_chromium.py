"""Headless Chromium driven over the DevTools protocol with aiohttp's websocket client: what the
web page's test needs of a real browser (navigate, evaluate, type, click, screenshot), without
playwright or selenium (they download their own browsers, which needs a network)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """The first Chromium on PATH (Debian's package is `chromium`), or None."""
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class Chromium:
    """A headless Chromium this process starts with its own profile in ``folder``; ``close``
    ends it. ``port`` is its DevTools port, read from the DevToolsActivePort file it writes."""

    def __init__(self, binary: str, folder: Path, width: int = 1400, height: int = 900) -> None:
        self.folder = folder
        active = folder / "DevToolsActivePort"
        self.process = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
                f"--user-data-dir={folder}",
                f"--window-size={width},{height}",
                "--no-sandbox",  # root in a container has no user namespaces for the sandbox
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--hide-scrollbars",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not (active.exists() and active.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not start (exit {self.process.returncode})")
            time.sleep(0.05)
        self.port = int(active.read_text().split()[0])

    async def open(self, session: aiohttp.ClientSession) -> Tab:
        """The first page target, connected."""
        async with session.get(f"http://127.0.0.1:{self.port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        tab = Tab(await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0))
        await tab.send("Page.enable")
        await tab.send("Runtime.enable")
        return tab

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Tab:
    """One page over its websocket: commands answered by id, events kept in ``events``."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.socket = socket
        self.next_id = 0
        self.waiting: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self.socket:
            data = json.loads(message.data)
            if "id" in data:
                future = self.waiting.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            else:
                self.events.append(data)

    async def send(self, method: str, **params) -> dict:
        self.next_id += 1
        future = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = future
        await self.socket.send_json({"id": self.next_id, "method": method, "params": params})
        answer = await asyncio.wait_for(future, 30)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer["result"]

    async def evaluate(self, expression: str):
        """``expression``'s value in the page (awaited when a promise); raises on a throw."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30):
        """``expression``'s first truthy value, polled; TimeoutError with its last value."""
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{expression} stayed {value!r} for {timeout_s} s")

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def click(self, selector: str) -> None:
        """A real mouse click at the middle of the element."""
        box = await self.evaluate(
            f"(() => {{ const r = document.querySelector({selector!r}).getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent",
                type=kind,
                x=box[0],
                y=box[1],
                button="left",
                clickCount=1,
            )

    async def type(self, selector: str, text: str) -> None:
        """Focus the element (by clicking it) and type ``text`` as keyboard input."""
        await self.click(selector)
        await self.send("Input.insertText", text=text)

    async def screenshot(self) -> bytes:
        result = await self.send("Page.captureScreenshot", format="png")
        return base64.b64decode(result["data"])

    def exceptions(self) -> list[str]:
        """Uncaught exceptions and console errors the page raised so far."""
        found = []
        for event in self.events:
            if event.get("method") == "Runtime.exceptionThrown":
                found.append(json.dumps(event["params"]["exceptionDetails"])[:500])
            elif (
                event.get("method") == "Runtime.consoleAPICalled"
                and event["params"]["type"] == "error"
            ):
                found.append(json.dumps(event["params"]["args"])[:500])
        return found

    async def close(self) -> None:
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader
        await self.socket.close()

"""The web page at ``/`` on the real daemon (bundled models), over TCP with its bearer token:
served to browsers (tools keep Ollama's line) in well under a second on the socket and on TCP,
then driven in headless Chromium over the DevTools protocol: a typed question streams its
answer, the plots update, and the figures the page shows are those ``/metrics`` gives; the stop
button, a worker's restart and the daemon's shutdown are said in words, never a stack trace.

Chromium is Debian's package (``apt-get install chromium``); without it the browser tests skip.
``HETSPEC_WEB_PAGE_SCREENSHOT=docs/web-page.png`` keeps the screenshot taken after an answer.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import pytest
from headless_chromium import Chromium, find_chromium
from prometheus_client.parser import text_string_to_metric_families
from test_api import free_port
from test_lossless import BundledDaemon

from hetspec.daemon.api.web_page import prefers_html

pytestmark = pytest.mark.process

TOKEN = "test-token-web-page-0123456789"
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
CHROMIUM = find_chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)"
)
QUESTION = "Write a Python function that adds two numbers."


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    daemon = BundledDaemon(
        tmp_path_factory.mktemp("web"),
        "draft-cpu",
        "--set",
        f'tcp.listen="127.0.0.1:{port}"',
        "--set",
        f'tcp.token="{TOKEN}"',
    )
    daemon.url = f"http://127.0.0.1:{port}"
    yield daemon
    daemon.stop()


def on_socket(daemon) -> httpx.Client:
    transport = httpx.HTTPTransport(uds=str(daemon.socket))
    return httpx.Client(transport=transport, base_url="http://hetspecd", timeout=60)


def metrics_of(daemon) -> dict[str, float]:
    """Each /metrics sample summed over its labels, by sample name."""
    with on_socket(daemon) as http:
        text = http.get("/metrics").text
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def assets_of(fetch, page: str) -> set[str]:
    """Every file the page loads: its stylesheet and scripts, and the modules they import."""
    found = set(re.findall(r'(?:src|href)="(/web/[^"]+)"', page))
    pending = list(found)
    while pending:
        path = pending.pop()
        if path.endswith(".js"):
            for name in re.findall(r'from "\./([^"]+)"', fetch(path).text):
                if f"/web/{name}" not in found:
                    found.add(f"/web/{name}")
                    pending.append(f"/web/{name}")
    return found


def timed_get(http: httpx.Client, path: str, **headers) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    response = http.get(path, headers=headers)
    return response, time.perf_counter() - started


@pytest.mark.parametrize(
    ("accept", "html"),
    [
        (BROWSER_ACCEPT, True),  # Chromium's and Firefox's navigation
        ("text/html", True),
        ("*/*", False),  # curl, httpx, requests
        ("", False),
        ("application/json", False),
        ("application/json, text/html;q=0.5", False),
        ("text/html;q=0", False),
        ("text/html;q=oops, text/plain", False),
    ],
)
def test_html_goes_to_clients_that_prefer_it(accept: str, html: bool) -> None:
    assert prefers_html(accept) is html


def test_root_is_the_page_for_browsers_and_the_line_for_tools(daemon) -> None:
    with on_socket(daemon) as local, httpx.Client(base_url=daemon.url, timeout=60) as remote:
        for http in (local, remote):  # the page needs no token over TCP: it asks for it
            page, seconds = timed_get(http, "/", Accept=BROWSER_ACCEPT)
            assert page.status_code == 200, page.text
            assert page.headers["Content-Type"].startswith("text/html")
            assert "<title>hetspecd</title>" in page.text
            assert "default-src 'self'" in page.headers["Content-Security-Policy"]
            assert seconds < 1.0, f"the page took {seconds:.3f} s"
            assets = assets_of(http.get, page.text)
            assert {"/web/page.css", "/web/page.js", "/web/plots.js"} <= assets
            for path in assets:
                asset, seconds = timed_get(http, path)
                assert asset.status_code == 200, path
                assert seconds < 1.0, f"{path} took {seconds:.3f} s"
            assert http.get("/web/missing.js").status_code == 404

        for accept in ("*/*", "application/json"):  # Ollama's probe, as before
            line = local.get("/", headers={"Accept": accept})
            assert line.text.startswith("hetspecd "), line.text
        assert local.head("/").status_code == 200

        # over TCP every API call needs the token; the page's files alone do not
        assert remote.get("/").status_code == 401
        assert remote.get("/props", headers={"Accept": BROWSER_ACCEPT}).status_code == 401
        assert remote.post("/web/page.js").status_code == 401
        with_token = {"Authorization": f"Bearer {TOKEN}"}
        assert remote.get("/", headers=with_token).text.startswith("hetspecd ")


# ----------------------------------------------------------------- in the browser


@pytest.fixture
async def tab(tmp_path):
    browser = Chromium(CHROMIUM, tmp_path / "chromium")
    try:
        async with aiohttp.ClientSession() as session:
            tab = await browser.open(session)
            yield tab
            await tab.close()
    finally:
        browser.close()


def text_of(element: str) -> str:
    return f"document.querySelector({element!r}).textContent"


async def open_page(tab, daemon) -> None:
    """Open the page over TCP and give it the token, as a user would; ready once it polled."""
    await tab.navigate(daemon.url + "/")
    await tab.wait_for(f"{text_of('#status')}.includes('bearer token')")
    await tab.type("#token", TOKEN)
    await tab.click("#token-form button")
    await tab.wait_for("document.querySelector('#status').dataset.state === 'ready'")


async def shown(tab) -> dict[str, float | None]:
    """The totals the page shows, by the figure's name."""
    values = await tab.evaluate(
        "Object.fromEntries([...document.querySelectorAll('[data-metric]')]"
        ".map(cell => [cell.dataset.metric, cell.dataset.value]))"
    )
    return {name: float(value) if value else None for name, value in values.items()}


async def plotted(tab, figure: str) -> tuple[int, float | None]:
    """How many values a plot draws, and the last of its first series."""
    points, last = await tab.evaluate(
        f"(c => [c.dataset.points, c.dataset.last])(document.querySelector('#{figure} canvas'))"
    )
    return int(points or 0), float(last) if last else None


@needs_chromium
async def test_a_question_streams_and_the_plots_show_the_metrics_figures(
    daemon, tab, tmp_path
) -> None:
    before = metrics_of(daemon)
    await open_page(tab, daemon)
    await tab.type("#system", "You are a careful programmer.")
    await tab.type("#prompt", QUESTION)
    await tab.click("#send")
    await tab.wait_for("document.querySelector('#stop').disabled === false", 5)
    await tab.wait_for("document.querySelector('.turn.assistant')?.dataset.done", 60)
    answer = await tab.evaluate(text_of(".turn.assistant"))
    assert answer.strip()
    tokens = int(await tab.evaluate("document.querySelector('#answer-stats').dataset.tokens"))
    assert tokens >= 1
    generated = before["hetspec_generated_tokens_total"] + tokens
    # the page polls /metrics every second: wait for the poll that saw the answer
    await tab.wait_for(
        "document.querySelector('[data-metric=hetspec_generated_tokens_total]')"
        f".dataset.value === '{generated:g}'",
        10,
    )
    after = metrics_of(daemon)
    assert after["hetspec_generated_tokens_total"] == generated
    page = await shown(tab)
    for name in (
        "hetspec_generated_tokens_total",
        "hetspec_speculative_rounds_total",
        "hetspec_draft_tokens_total",
        "hetspec_draft_accepted_tokens_total",
        "hetspec_queue_waiting",
    ):
        assert page[name] == after[name], name
    rounds = after["hetspec_speculative_rounds_total"]
    accepted = after["hetspec_draft_accepted_tokens_total"]
    assert page["accepted_per_round"] == accepted / rounds
    rate_sum = after["hetspec_decode_tokens_per_second_sum"]
    rate_count = after["hetspec_decode_tokens_per_second_count"]
    assert page["decode_tokens_per_second_mean"] == rate_sum / rate_count

    # the plots drew the answer: per interval, the same figures /metrics gives for it
    new_rounds = rounds - before["hetspec_speculative_rounds_total"]
    assert new_rounds >= 1
    new_accepted = accepted - before["hetspec_draft_accepted_tokens_total"]
    assert await plotted(tab, "plot-accepted") == (1, new_accepted / new_rounds)
    new_rates = rate_sum - before["hetspec_decode_tokens_per_second_sum"]
    assert await plotted(tab, "plot-rate") == (1, new_rates / 1)
    # a gamma bar and a branch count for each of the answer's rounds
    assert (await plotted(tab, "plot-gamma"))[0] == 2 * new_rounds
    assert (await plotted(tab, "plot-overlap"))[0] == 2  # its rounds, its overlapped rounds
    assert (await plotted(tab, "plot-costs"))[0] >= 2  # the verifier's cost at two widths

    picture = await tab.screenshot()
    assert picture.startswith(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "web-page.png").write_bytes(picture)
    if keep := os.environ.get("HETSPEC_WEB_PAGE_SCREENSHOT"):
        Path(keep).write_bytes(picture)
    assert "Traceback" not in await tab.evaluate("document.body.innerText")
    assert tab.exceptions() == []


async def queue_reaches(daemon, condition, timeout_s: float = 30) -> dict:
    """/props' queue once ``condition(queue)`` holds, polled every 20 ms."""
    deadline = time.monotonic() + timeout_s
    with on_socket(daemon) as http:
        while time.monotonic() < deadline:
            queue = http.get("/props").json()["queue"]
            if condition(queue):
                return queue
            await asyncio.sleep(0.02)
    raise TimeoutError(f"the queue stayed {queue}")


@needs_chromium
async def test_stop_leaves_the_queue_and_the_page_says_so(daemon, tab) -> None:
    """An answer that waits behind a long one: stop takes it out of the queue."""
    await open_page(tab, daemon)
    long_one = threading.Thread(
        target=lambda: on_socket(daemon).post(
            "/api/generate",
            json={
                "prompt": "def main(",
                "raw": True,
                "stream": False,
                "ignore_eos": True,
                "mode": "autoregressive",
                "options": {"num_predict": 1800, "temperature": 0},
            },
        )
    )
    long_one.start()
    try:
        await queue_reaches(daemon, lambda queue: queue["running"])
        await tab.type("#prompt", QUESTION)
        await tab.click("#send")
        await queue_reaches(daemon, lambda queue: queue["waiting"] == 1)
        await tab.click("#stop")
        await tab.wait_for("document.querySelector('.turn.note')?.textContent === 'stopped'", 5)
        await queue_reaches(daemon, lambda queue: queue["waiting"] == 0)
        # it never began: no answer on the page, the question still there
        assert await tab.evaluate("document.querySelector('.turn.assistant')") is None
        assert await tab.evaluate(text_of(".turn.user")) == QUESTION
        assert await tab.evaluate("document.querySelector('#send').disabled") is False
    finally:
        await asyncio.to_thread(long_one.join, 120)
    assert tab.exceptions() == []


@needs_chromium
async def test_a_worker_restart_and_a_shutdown_are_said_and_survived(daemon, tab) -> None:
    """Last in this file: it stops the module's daemon."""
    await open_page(tab, daemon)
    with on_socket(daemon) as http:
        worker = http.get("/health").json()["workers"]["cpu"]
    os.kill(worker["pid"], signal.SIGKILL)
    await tab.wait_for(f"{text_of('#status')}.includes('the cpu worker restarted')", 60)
    assert await tab.evaluate("document.querySelector('#status').dataset.state") == "ready"

    stopping = asyncio.create_task(asyncio.to_thread(daemon.stop))
    await tab.wait_for(f"{text_of('#status')}.includes('cannot be reached')", 90)
    await stopping
    assert await tab.evaluate("document.querySelector('#status').dataset.state") == "down"
    body = await tab.evaluate("document.body.innerText")
    assert "Traceback" not in body
    assert "Error:" not in body
    assert tab.exceptions() == []

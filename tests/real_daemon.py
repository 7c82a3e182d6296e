"""A real hetspecd on the bundled models listening on the Unix socket and on loopback TCP
with a bearer token, and the clients users reach it with: shared by the API test modules
(each starts its own daemon: their requests must not queue behind another module's)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import ollama
import openai
from test_api import free_port
from test_lossless import BundledDaemon


@contextlib.contextmanager
def tcp_daemon(folder, token: str, *extra: str) -> Iterator[BundledDaemon]:
    """hetspecd (placement draft-cpu) in ``folder``, also on 127.0.0.1:``daemon.port``."""
    port = free_port()
    daemon = BundledDaemon(
        folder,
        "draft-cpu",
        "--set",
        f'tcp.listen="127.0.0.1:{port}"',
        "--set",
        f'tcp.token="{token}"',
        *extra,
    )
    daemon.port = port
    try:
        yield daemon
    finally:
        daemon.stop()


@contextlib.contextmanager
def socket_http(daemon, timeout: float = 120) -> Iterator[httpx.Client]:
    """httpx over the Unix socket, as a user of the box reaches the daemon."""
    transport = httpx.HTTPTransport(uds=str(daemon.socket))
    with httpx.Client(transport=transport, base_url="http://hetspecd", timeout=timeout) as http:
        yield http


@contextlib.contextmanager
def ollama_client(daemon) -> Iterator[ollama.Client]:
    """Ollama's client on the Unix socket."""
    transport = httpx.HTTPTransport(uds=str(daemon.socket))
    with ollama.Client(host="http://hetspecd", transport=transport, timeout=120) as client:
        yield client


def openai_client(daemon, token: str) -> openai.OpenAI:
    """OpenAI's client over TCP, as a tool elsewhere on the network would."""
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key=token, max_retries=0, timeout=120
    )

"""HOST:PORT endpoints, as configuration files and command lines write them."""

from __future__ import annotations

import ipaddress


def parse_endpoint(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); ValueError with one line otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an endpoint is HOST:PORT (port 1..65535), not {text!r}")
    return host, int(port)


def parse_rpc_endpoint(text: str) -> tuple[str, int]:
    """``parse_endpoint`` for llama.cpp's RPC, which splits an endpoint at its first ':' and so
    takes IPv4 addresses and host names only."""
    host, port = parse_endpoint(text)
    if ":" in host:
        raise ValueError(f"{text!r}: llama.cpp's RPC takes IPv4 addresses or host names, not IPv6")
    return host, port


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

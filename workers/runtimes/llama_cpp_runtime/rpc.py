"""llama.cpp's RPC backend: a model's layers on other hosts' rpc-servers, and such a server.

llama.cpp's RPC protocol has no authentication and no encryption; a server must be reachable
only over a private link or a tunnel (docs/beyond-one-box.md). The functions come from the
ggml library that llama-cpp-python loaded, looked up through the RPC backend's registry entry
as llama.cpp's own tools do, so client and server are always the same llama.cpp.
"""

from __future__ import annotations

import ctypes
import socket

from hetspec.endpoints import parse_rpc_endpoint
from hetspec.workers.runtimes.llama_cpp_runtime import ggml

REACH_TIMEOUT_S = 3.0

_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_START_SERVER = ctypes.CFUNCTYPE(
    None,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_void_p),
)


class RpcError(RuntimeError):
    """An rpc-server cannot be used: a malformed endpoint, nobody listening, no RPC backend."""


def _rpc_function(name: str, prototype):
    registry = ggml.reg_by_name(b"RPC")
    if not registry:
        raise RpcError(
            "this llama-cpp-python was built without llama.cpp's RPC backend; reinstall it with "
            "native/install-llama-cpp.sh (it builds with -DGGML_RPC=ON)"
        )
    address = ggml.reg_proc_address(registry, name.encode())
    if not address:
        raise RpcError(f"llama.cpp's RPC backend has no {name}")
    return prototype(address)


def check_reachable(endpoint: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raise RpcError unless something accepts TCP connections at ``endpoint``: llama.cpp
    aborts the whole process when it cannot connect, so this is checked first."""
    try:
        host, port = parse_rpc_endpoint(endpoint)
    except ValueError as error:
        raise RpcError(f"rpc server {error}") from None
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        raise RpcError(
            f"cannot reach the rpc-server at {endpoint}: {reason} (is `hetspec-rpc-server` or "
            "llama.cpp's rpc-server running there, and the tunnel up?)"
        ) from None


def add_servers(endpoints: tuple[str, ...] | list[str]) -> list[int]:
    """Register each server's devices with ggml, as llama.cpp's ``--rpc`` does, and return
    them, in order, for a model load to name (a process keeps every server it ever registered:
    a load that took all of them would reach for servers long gone). A server registered
    before is not added twice."""
    add_server = _rpc_function("ggml_backend_rpc_add_server", _ADD_SERVER)
    devices = []
    for endpoint in endpoints:
        check_reachable(endpoint)
        registry = ggml.reg_by_name(f"RPC[{endpoint}]".encode())
        if not registry:
            registry = add_server(endpoint.encode())
            if not registry:
                raise RpcError(f"the rpc-server at {endpoint} offers no device")
            ggml.register(registry)
        devices += [ggml.reg_dev_get(registry, i) for i in range(ggml.reg_dev_count(registry))]
    if not devices:
        raise RpcError(f"the rpc-servers {', '.join(endpoints)} offer no device")
    return devices


def serve(endpoint: str, threads: int, cache_dir: str | None = None) -> None:
    """Serve this machine's CPU to RPC clients at ``endpoint``; returns only if the server
    cannot start (llama.cpp prints why)."""
    start_server = _rpc_function("ggml_backend_rpc_start_server", _START_SERVER)
    cpu = ggml.dev_by_type(ggml.DEVICE_CPU)
    if not cpu:
        raise RpcError("ggml offers no CPU device")
    devices = (ctypes.c_void_p * 1)(cpu)
    cache = cache_dir.encode() if cache_dir else None
    start_server(endpoint.encode(), cache, threads, 1, devices)

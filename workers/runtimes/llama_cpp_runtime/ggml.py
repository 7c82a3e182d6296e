"""The few ggml backend-registry functions hetspec calls, from the ggml library that
llama-cpp-python loaded (it binds llama.cpp's API but not these)."""

from __future__ import annotations

import ctypes
import os

import llama_cpp  # noqa: F401 - loads libllama, and with it the libggml it links
from llama_cpp._ggml import libggml as _packaged


def _libggml() -> ctypes.CDLL:
    """The libggml instance libllama links. llama-cpp-python's ``_ggml`` loads the file
    ``libggml.so``, which a wheel carries as a copy of ``libggml.so.0``, not a link to it:
    a second instance with a registry of its own, so rpc-servers registered there were never
    seen by the model loader (every "offloaded" layer ran on this CPU). The instance already
    loaded under its SONAME is the one that counts."""
    nolo = getattr(os, "RTLD_NOLOAD", None)
    if nolo is not None:
        for soname in ("libggml.so.0", "libggml.so"):
            try:
                return ctypes.CDLL(soname, mode=nolo | os.RTLD_NOW)
            except OSError:
                continue
    return _packaged


libggml = _libggml()

DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU = 0, 1, 2  # enum ggml_backend_dev_type


def _bind(name: str, argtypes: list, restype):
    function = getattr(libggml, name)
    function.argtypes, function.restype = argtypes, restype
    return function


reg_by_name = _bind("ggml_backend_reg_by_name", [ctypes.c_char_p], ctypes.c_void_p)
reg_proc_address = _bind(
    "ggml_backend_reg_get_proc_address", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
)
register = _bind("ggml_backend_register", [ctypes.c_void_p], None)
dev_by_type = _bind("ggml_backend_dev_by_type", [ctypes.c_int], ctypes.c_void_p)
dev_count = _bind("ggml_backend_dev_count", [], ctypes.c_size_t)
dev_get = _bind("ggml_backend_dev_get", [ctypes.c_size_t], ctypes.c_void_p)
dev_type = _bind("ggml_backend_dev_type", [ctypes.c_void_p], ctypes.c_int)
dev_reg = _bind("ggml_backend_dev_backend_reg", [ctypes.c_void_p], ctypes.c_void_p)
reg_name = _bind("ggml_backend_reg_name", [ctypes.c_void_p], ctypes.c_char_p)
reg_dev_count = _bind("ggml_backend_reg_dev_count", [ctypes.c_void_p], ctypes.c_size_t)
reg_dev_get = _bind("ggml_backend_reg_dev_get", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p)


def local_gpus() -> list[int]:
    """The GPU devices of this machine this llama.cpp build sees (an rpc-server's devices
    register as GPUs too: not those)."""
    return [
        device
        for device in map(dev_get, range(dev_count()))
        if dev_type(device) in (DEVICE_GPU, DEVICE_IGPU)
        and not reg_name(dev_reg(device)).startswith(b"RPC")
    ]


def local_gpu_present() -> bool:
    """Whether this llama.cpp build sees a GPU of this machine. (llama.cpp's own
    ``llama_supports_gpu_offload`` also answers yes for any build with the RPC backend.)"""
    return bool(local_gpus())

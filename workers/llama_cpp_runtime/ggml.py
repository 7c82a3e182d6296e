"""The few ggml backend-registry functions hetspec calls, from the ggml library that
llama-cpp-python loaded (it binds llama.cpp's API but not these)."""

from __future__ import annotations

import ctypes

from llama_cpp._ggml import libggml

DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU = 0, 1, 2  # enum ggml_backend_dev_type


def _bind(name: str, argtypes: list, restype):
    function = getattr(libggml, name)
    function.argtypes, function.restype = argtypes, restype
    return function


reg_by_name = _bind("ggml_backend_reg_by_name", [ctypes.c_char_p], ctypes.c_void_p)
reg_proc_address = _bind("ggml_backend_reg_get_proc_address",
                         [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p)  # fmt: skip
register = _bind("ggml_backend_register", [ctypes.c_void_p], None)
dev_by_type = _bind("ggml_backend_dev_by_type", [ctypes.c_int], ctypes.c_void_p)
dev_count = _bind("ggml_backend_dev_count", [], ctypes.c_size_t)
dev_get = _bind("ggml_backend_dev_get", [ctypes.c_size_t], ctypes.c_void_p)
dev_type = _bind("ggml_backend_dev_type", [ctypes.c_void_p], ctypes.c_int)
dev_reg = _bind("ggml_backend_dev_backend_reg", [ctypes.c_void_p], ctypes.c_void_p)
reg_name = _bind("ggml_backend_reg_name", [ctypes.c_void_p], ctypes.c_char_p)


def local_gpu_present() -> bool:
    """Whether this llama.cpp build sees a GPU of this machine. (llama.cpp's own
    ``llama_supports_gpu_offload`` also answers yes for any build with the RPC backend, and
    an rpc-server's devices register as GPUs.)"""
    for index in range(dev_count()):
        device = dev_get(index)
        if dev_type(device) in (DEVICE_GPU, DEVICE_IGPU) and \
                not reg_name(dev_reg(device)).startswith(b"RPC"):  # fmt: skip
            return True
    return False

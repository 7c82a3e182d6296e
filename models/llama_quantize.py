"""K-quant and IQ4 GGUF files (Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, IQ4_NL), made by llama.cpp's own
quantizer.

Most GGUF files users download are K-quants; gguf-py cannot write them, so a model hetspec
builds itself (a heavy target) gets them the way their publishers make them: llama.cpp's
``llama_model_quantize`` from an F16 export, with its per-tensor choices (Q4_K_M keeps
``attn_v``, half of ``ffn_down`` and the output head at Q6_K). Needs llama-cpp-python.

From a model folder: ``python -m hetspec.models.gguf_export MODEL_DIR OUT.gguf --type q4_k_m``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

# our type name -> llama.cpp's file type (llama_ftype): the same numbers as gguf's LlamaFileType
QUANT_TYPES = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "iq4_xs": 30, "iq4_nl": 25}


class QuantizeError(ValueError):
    """The quantizer could not run or refused the file; the message says why."""


def quantize_gguf(source: Path, out: Path, quant_type: str, threads: int | None = None) -> Path:
    """Write ``source`` (an F16 or F32 GGUF) quantized to ``quant_type`` at ``out``."""
    if quant_type not in QUANT_TYPES:
        raise QuantizeError(
            f"unknown quantization {quant_type!r}; choose from {', '.join(QUANT_TYPES)}"
        )
    if not Path(source).is_file():
        raise QuantizeError(f"{source}: no such file")
    try:
        import llama_cpp  # noqa: PLC0415 - optional and heavy
    except ImportError as error:
        raise QuantizeError(f"K-quants are made by llama.cpp's quantizer: {error}") from None
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[quant_type]
    params.nthread = threads or len(os.sched_getaffinity(0))
    log: list[str] = []  # its line per tensor, kept for an error message instead of printed

    def keep(_level: int, text: bytes, _user_data: int) -> None:
        log.append(text.decode("utf-8", "replace"))

    # llama.cpp's log hook is one per process: whatever was installed (e.g. a llama.cpp
    # worker's LlamaLog) gets it back afterwards
    previous, previous_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(previous_data))
    callback = llama_cpp.llama_log_callback(keep)  # alive until the hook is restored below
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        status = llama_cpp.llama_model_quantize(
            str(source).encode(), str(out).encode(), ctypes.byref(params)
        )
    finally:
        llama_cpp.llama_log_set(previous, previous_data)
    if status != 0 or not Path(out).is_file():
        last = " ".join("".join(log).split())[-300:]
        raise QuantizeError(
            f"llama.cpp could not quantize {source} to {quant_type} (status {status}): {last}"
        )
    return Path(out)

"""Loading a runtime in this process: which engine a worker's ``--runtime`` names, and the
cores it computes on.

Contract: ``claim_cores`` runs first, before any runtime is imported (thread pools size
themselves from the affinity, and OpenMP reads its places as it loads); ``load_runtime`` then
imports and builds the engine only now, in this process, and returns it with the device it
computes on in words. Every failure to load is a ``LoadError`` whose message says why (and,
where one helps, what to change). Used by the worker process, the profiling tool and the
benchmarks alike, so that each loads a runtime exactly as a worker does.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import msgspec

from hetspec.protocol import worker_messages as m
from hetspec.workers.runtimes.spare_cores import SPARE_CORES_SPIN_COUNT, openmp_places

RUNTIMES = ("llama.cpp", "torch", "native", "head")


class LoadError(RuntimeError):
    """The model could not be loaded; the message says why."""


def load_runtime(kind: str, model: str, settings: m.RuntimeSettings, sequences: int = 1):
    """Import and build the engine only now, in this process, after the cores are set; with
    ``sequences`` > 1, the native and llama.cpp engines open that many sharing the weights
    (``sequence_engines``), torch's and the draft head's one (their CUDA graphs and static
    forwards are built on one cache)."""
    if sequences < 1:
        raise LoadError(f"a worker serves at least one sequence, not {sequences}")
    options = {k: v for k, v in msgspec.structs.asdict(settings).items() if v is not None}
    if kind == "llama.cpp":
        from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppError, LlamaCppRuntime  # noqa: PLC0415

        if not isinstance(settings, m.LlamaCppSettings):
            raise LoadError("the llama.cpp worker takes llama.cpp settings")
        try:
            runtime = LlamaCppRuntime(model, sequences=sequences, **options)
            return runtime, "gpu (llama.cpp)" if runtime.offloaded else "cpu"
        except LlamaCppError as error:
            raise LoadError(str(error)) from None
    if kind == "native":
        from hetspec.native.kernels import NativeUnavailable  # noqa: PLC0415
        from hetspec.workers.runtimes.native_runtime import NativeRuntime  # noqa: PLC0415

        if not isinstance(settings, m.NativeSettings):
            raise LoadError("the native worker takes native settings")
        try:
            runtime = NativeRuntime(model, sequences=sequences, **options)
            return runtime, f"cpu (native, {runtime.kernels})"
        except NativeUnavailable as error:
            raise LoadError(str(error)) from None
    from hetspec.workers.runtimes.torch_runtime import ModelLoadError  # noqa: PLC0415

    if kind == "head":
        from hetspec.workers.runtimes.torch_runtime.head_runtime import HeadRuntime  # noqa: PLC0415

        if not isinstance(settings, m.HeadSettings):
            raise LoadError("the draft head's worker takes draft-head settings")
        try:
            runtime = HeadRuntime(model, **options)
        except ModelLoadError as error:
            raise LoadError(str(error)) from None
        return runtime, f"{runtime.device} (draft head)"
    if not isinstance(settings, m.TorchSettings):
        raise LoadError("the torch worker takes torch settings")
    return load_torch(model, settings, options)


def sequence_engines(runtime) -> list:
    """The engines of a loaded runtime's sequences: the runtime itself (sequence 0), then
    the others sharing its weights (its ``siblings``, where it has any)."""
    return [runtime, *getattr(runtime, "siblings", ())]


def load_torch(model: str, settings: m.TorchSettings, options: dict):
    import torch  # noqa: PLC0415

    from hetspec.workers.runtimes.torch_runtime import ModelLoadError, TorchRuntime  # noqa: PLC0415

    if settings.matmul_tiling is not None:  # the fields it changes, as plain values
        tiling = msgspec.structs.asdict(settings.matmul_tiling)
        options["matmul_tiling"] = {k: v for k, v in tiling.items() if v is not None}
    options.pop("split_ratio", None)
    options.pop("split_cache", None)
    notes = []
    try:
        if settings.split_ratio is not None:  # HCMP: or one line why not, then unsplit
            from hetspec.workers.runtimes.torch_runtime.hcmp_choice import load_split  # noqa: PLC0415

            split = load_split(model, settings)
            if split.runtime is not None:
                split.runtime.vocab_info()
                return split.runtime, f"{split.runtime.device} ({split.words})"
            notes.append(split.words)
        runtime = TorchRuntime(model, **options)
        runtime.vocab_info()  # a folder without a usable tokenizer fails here, at load
    except ModelLoadError as error:
        raise LoadError(str(error)) from None
    except torch.cuda.OutOfMemoryError as error:  # weights, KV cache and graphs: say what helps
        why = (str(error).splitlines() or ["out of memory"])[0]
        raise LoadError(
            f"{model} does not fit in the GPU's free memory ({why}): a smaller gpu_worker."
            'max_context shrinks its KV cache, gpu_worker.weights = "int8" halves its weights'
        ) from None
    if runtime.weights == "int8":
        notes.append("int8 weights")
    if runtime.matmul_refused:  # slower, never wrong: say so
        notes.append(f"matmul torch: the Triton kernel refused: {runtime.matmul_refused}")
    if runtime.in_place_differed:  # slower, never wrong: say so
        notes.append("chains gather their paths: in place differed")
    if runtime.attention == "split":
        how = "Triton kernel" if runtime.split_kernel else "torch"
        if runtime.split_kernel_refused:  # slower, never wrong: say so
            how += f"; its kernel refused: {runtime.split_kernel_refused}"
        notes.append(f"split attention, {how}")
    return runtime, f"{runtime.device} ({', '.join(notes)})" if notes else str(runtime.device)


def preload_runtime(kind: str) -> None:
    """Load the runtime's native libraries now. OpenMP (libgomp) counts the CPUs this
    process may use once, as it loads; loaded while the spare cores are allowed, its threads
    between two wide calls wait by spinning briefly, as they should. Loaded with the own
    cores only, it sees more threads than CPUs whenever a call computes wide and puts its
    threads to sleep after every step: 3 ms a demo-target token instead of 0.4."""
    modules = {
        "llama.cpp": "llama_cpp",
        "torch": "torch",
        "native": "hetspec.native._hsnative",
        "head": "torch",
    }
    with contextlib.suppress(ImportError):  # kernels not built: loading the model says so
        importlib.import_module(modules[kind])


def core_list(text: str) -> set[int]:
    return {int(core) for core in text.split(",") if core}


def claim_cores(runtime: str, own: set[int], spare: set[int]) -> None:
    """Run on ``own`` cores, with OpenMP placed so that a wide call's extra threads run on the
    ``spare`` ones (see spare_cores.py); before any runtime is imported, since thread pools
    size themselves from the affinity and OpenMP reads its places as it loads."""
    if not own:
        return
    os.sched_setaffinity(0, own | spare)
    if spare - own:
        # replacing a user's OMP_PROC_BIND=false, which would stack the threads on one core
        os.environ.update(openmp_places(own, spare))
        os.environ.setdefault("GOMP_SPINCOUNT", SPARE_CORES_SPIN_COUNT)
        preload_runtime(runtime)
    os.sched_setaffinity(0, own)  # this thread, OpenMP's master, and threads it starts

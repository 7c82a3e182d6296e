"""``python -m hetspec.workers.tools.profile RUNTIME MODEL``: what a forward costs a runtime here.

Loads MODEL in RUNTIME exactly as a worker would (the same settings, pinned to the same
cores), commits a context of ``--prefix`` tokens, then times one forward of w chained tokens
for each width w (the forwarded tokens are dropped again after every repeat, so the context
stays the same). Prints one JSON line on stdout, a ``hetspec.protocol`` profile, and exits 0
even when the model cannot load (that is a ``ProbeFailure``, so the daemon can say why). Runs
in a process of its own, like a worker, so the daemon never imports torch or llama.cpp.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import msgspec
import numpy as np

from hetspec.protocol import ProbeFailure, RuntimeProfile, encode_runtime_report
from hetspec.protocol import worker_messages as m
from hetspec.workers.runtimes.loading import (
    RUNTIMES,
    LoadError,
    claim_cores,
    core_list,
    load_runtime,
)
from hetspec.workers.runtimes.spare_cores import SpareCores
from hetspec.workers.tools.timing import positive_int_list, timed_ms


def profile(
    runtime_name: str,
    model: str,
    settings: m.RuntimeSettings,
    *,
    widths: list[int],
    prefix: int,
    repeats: int,
    fbgemm_int8: bool = False,
    spare: SpareCores | None = None,
) -> RuntimeProfile:
    """Load ``model`` and time its forwards (on the ``spare`` cores too, where given); raises
    ``LoadError`` if it cannot load."""
    start = time.perf_counter()
    runtime, device = load_runtime(runtime_name, model, settings)
    if spare is not None:
        spare.use(True, runtime.set_extra_threads)
    if fbgemm_int8:
        if runtime_name != "torch":
            raise LoadError("--fbgemm-int8 applies to the torch runtime only")
        import torch  # noqa: PLC0415

        # the decoder layers' linears; the output head stays f32 (the runtime reads its weight)
        runtime.model.model = torch.ao.quantization.quantize_dynamic(
            runtime.model.model, {torch.nn.Linear}, dtype=torch.qint8
        )
        device += " (fbgemm int8)"
    load_s = time.perf_counter() - start
    medians = forward_medians(runtime, widths=widths, prefix=prefix, repeats=repeats)
    return RuntimeProfile(
        runtime=runtime_name,
        device=device,
        model=model,
        prefix=prefix,
        widths=widths,
        median_ms=medians,
        load_s=round(load_s, 3),
        cores=sorted(os.sched_getaffinity(0)),
        spare_cores=sorted(spare.spare) if spare is not None and spare.wide else [],
    )


def forward_medians(runtime, *, widths: list[int], prefix: int, repeats: int) -> list[float]:
    """Median ms of one forward of w chained tokens after ``prefix`` committed ones, per w."""
    # Token ids spread over the vocabulary: the cost of a forward does not depend on them.
    rng = np.random.default_rng(0)
    context = rng.integers(0, runtime.vocab_size, prefix + max(widths)).tolist()
    runtime.warm_up(max(widths))  # torch prepares its kernels per shape on first use
    runtime.prefill(context[:prefix])
    medians = []
    for width in widths:
        chain = context[prefix : prefix + width]
        parents = list(range(-1, width - 1))

        def forward(chain=chain, parents=parents) -> None:
            runtime.evaluate_tree(chain, parents)
            runtime.discard_pending()

        medians.append(round(timed_ms(forward, repeats)[0], 4))
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.workers.tools.profile", description=__doc__
    )
    parser.add_argument("runtime", choices=RUNTIMES)
    parser.add_argument("model", help="a GGUF file (llama.cpp) or a model folder (torch)")
    parser.add_argument(
        "--settings",
        help="the worker's runtime settings as JSON (default: the runtime's own defaults)",
    )
    parser.add_argument("--widths", type=positive_int_list, default=[1, 2, 4, 8])
    parser.add_argument("--prefix", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cores", default="", help="comma-separated cores to run on")
    parser.add_argument(
        "--spare-cores",
        default="",
        help="comma-separated cores the worker "
        "also computes on while the other worker idles: the forwards are timed "
        "on both, as a verifier computes then",
    )
    parser.add_argument(
        "--fbgemm-int8",
        action="store_true",
        help="torch only: the decoder's linears as fbgemm dynamic int8 (not "
        "lossless: activations quantized per tensor), for comparison",
    )
    args = parser.parse_args(argv)
    own, spare = core_list(args.cores), core_list(args.spare_cores)
    claim_cores(args.runtime, own, spare)  # as the worker does, before the runtime loads
    try:
        defaults = {
            "llama.cpp": m.LlamaCppSettings,
            "torch": m.TorchSettings,
            "native": m.NativeSettings,
        }
        default = defaults[args.runtime]()
        settings = (
            msgspec.json.decode(args.settings, type=m.RuntimeSettings) if args.settings else default
        )
        result = profile(
            args.runtime,
            args.model,
            settings,
            widths=args.widths,
            prefix=args.prefix,
            repeats=args.repeats,
            fbgemm_int8=args.fbgemm_int8,
            spare=SpareCores(own, spare),
        )
    except (LoadError, msgspec.ValidationError, msgspec.DecodeError) as error:
        message = str(error)  # a runtime's own errors name the model
        if not message.startswith(args.model):
            message = f"{args.model}: {message}"
        result = ProbeFailure(runtime=args.runtime, message=message)
    except Exception as error:  # any runtime failure is a report, never a traceback
        result = ProbeFailure(
            runtime=args.runtime, message=f"{args.model}: {type(error).__name__}: {error}"
        )
    sys.stdout.buffer.write(encode_runtime_report(result) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m hetspec.bench.draft_cost MODEL``: a draft token as the rounds pay for it.

A drafter's call in a round first appends what the verifier kept (the accepted path, which
it already evaluated, and the bonus, which it has not), then drafts gamma tokens. This loads
MODEL in a CPU runtime as the drafting worker does, commits ``--prefix`` tokens, and times
such calls (the accepted count varying as a round's does), against the same runtime's chain
drafted alone after the same context (and, native, its kernels' chain call alone): the
per-token cost the controller sees beside what a forward takes, so the difference is the
runtime's own work around them.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from hetspec.protocol import worker_messages as m
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.workers.runtimes.loading import LoadError, claim_cores, core_list, load_runtime
from hetspec.workers.tools.timing import positive_int, positive_int_list

SETTINGS = {"native": m.NativeSettings, "llama.cpp": m.LlamaCppSettings}


def round_calls_us(runtime, gamma: int, *, prefix: int, rounds: int, seed: int = 0) -> float:
    """Mean us a drafted token over ``rounds`` draft calls of ``gamma`` tokens, each after
    appending a random share of the last draft and a bonus that is none of its tokens."""
    rng = np.random.default_rng(seed)
    params, sampler = SamplingParams(), DrawnSampler(seed)
    out = np.empty((1, gamma, runtime.vocab_size), np.float32)
    runtime.prefill(rng.integers(0, runtime.vocab_size, prefix).tolist())
    draft = runtime.draft(gamma, params, sampler, out=out)
    spent = 0.0
    for _ in range(rounds):
        accepted = int(rng.integers(0, gamma + 1))
        drafted = draft.tokens[0].tolist()
        bonus = (drafted[accepted] + 1) % runtime.vocab_size if accepted < gamma else 0
        start = time.perf_counter()
        if runtime.chains_in_one_call(params):  # as the worker does (workers/compute_handlers.py)
            first = runtime.catch_up([*drafted[:accepted], bonus])
            draft = runtime.draft(gamma, params, sampler, out=out, first=first)
        else:
            runtime.append([*drafted[:accepted], bonus])
            draft = runtime.draft(gamma, params, sampler, out=out)
        spent += time.perf_counter() - start
        if runtime.committed > prefix + 4 * gamma:  # the same context throughout
            runtime.rollback(prefix)
            draft = runtime.draft(gamma, params, sampler, out=out)
    return spent / rounds / gamma * 1e6


def forward_alone_us(runtime, gamma: int, *, prefix: int, repeats: int) -> float:
    """Median us a forward of the runtime's draft from the committed end, no append first
    (its first token drawn from the logits at hand: ``gamma`` + 1 tokens, ``gamma``
    forwards)."""
    params, sampler = SamplingParams(), DrawnSampler(0)
    runtime.rollback(prefix)
    samples = []
    for _ in range(repeats):
        runtime.discard_pending()
        start = time.perf_counter()
        runtime.draft(gamma + 1, params, sampler)
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)) / gamma * 1e6


def kernel_chain_us(runtime, gamma: int, *, prefix: int, repeats: int) -> float | None:
    """Median us a forward of the native kernels' chain call alone (None: not native)."""
    model = getattr(runtime, "model", None)
    if not hasattr(model, "draft_chain"):
        return None
    runtime.rollback(prefix)
    base = np.zeros(0, np.int32)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.draft_chain(
            1,
            gamma,
            position=prefix,
            start=prefix,
            prefix=prefix,
            base=base,
            threads=runtime.threads,
        )
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)) / gamma * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.bench.draft_cost", description=__doc__)
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument(
        "--runtimes",
        default="native,llama.cpp",
        help="comma-separated: native, llama.cpp (default both)",
    )
    parser.add_argument("--gammas", type=positive_int_list, default=[4, 8])
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--prefix", type=positive_int, default=256)
    parser.add_argument("--rounds", type=positive_int, default=300)
    parser.add_argument("--cores", default="", help="comma-separated cores to run on")
    args = parser.parse_args(argv)
    cores = core_list(args.cores)
    print(
        f"{os.path.basename(args.model)}: a draft token, {args.threads} thread(s), "
        f"{args.prefix} tokens of context; in rounds (the accepted path and a bonus "
        "appended first) against the same draft alone"
    )
    for name in args.runtimes.split(","):
        if name not in SETTINGS:
            parser.error(f"unknown runtime {name!r} (native, llama.cpp)")
        claim_cores(name, cores, set())
        try:
            runtime, device = load_runtime(name, args.model, SETTINGS[name](threads=args.threads))
        except LoadError as error:
            print(f"  {name}: cannot load: {error}")
            continue
        for gamma in args.gammas:
            in_rounds = round_calls_us(runtime, gamma, prefix=args.prefix, rounds=args.rounds)
            alone = forward_alone_us(runtime, gamma, prefix=args.prefix, repeats=args.rounds)
            kernel = kernel_chain_us(runtime, gamma, prefix=args.prefix, repeats=args.rounds)
            kernels = "" if kernel is None else f", the kernels' chain call {kernel:.1f}"
            print(
                f"  {device}, gamma {gamma}: in rounds {in_rounds:.1f} us a token; a forward "
                f"of a draft alone {alone:.1f}{kernels}"
            )
        if hasattr(runtime, "close"):
            runtime.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

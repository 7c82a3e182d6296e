"""Micro-benchmark: drafting b branches in one batch against b separate drafts.

    python -m hetspec.bench.llama_branches [--model GGUF] [--branches 2,4,8]

Multi-sequence drafting (DuoDecoding) only pays if growing b branches together, one
llama_decode per step for all of them, costs clearly less than drafting them one after another.
For each b this times b single-branch drafts of ``--steps`` tokens and one b-branch draft of the
same length from the same prompt, and prints the medians and their ratio (batched / separate:
1/b would be free branching, 1.0 no gain at all).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppError, LlamaCppRuntime
from hetspec.workers.tools.timing import positive_int_list, timed_ms

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "draft" / "draft-q8_0.gguf"
PROMPT = 'import os\n\n\ndef walk_tree(top):\n    """Yield every file below top."""\n'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.llama_branches", description=__doc__
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="GGUF file")
    parser.add_argument("--branches", type=positive_int_list, default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=8, help="tokens drafted per branch")
    parser.add_argument("--context", type=int, default=256, help="prompt length in tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (a 1-step draft evaluates nothing)")

    try:
        runtime = LlamaCppRuntime(
            args.model,
            n_ctx=args.context + args.steps * max(args.branches) + 16,
            n_seq_max=max(args.branches) + 1,
            threads=args.threads,
        )
    except LlamaCppError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    text_tokens = runtime.tokenize(PROMPT)
    prompt = (text_tokens * (args.context // len(text_tokens) + 1))[: args.context]
    runtime.prefill(prompt)
    params = SamplingParams(temperature=1.0)
    sampler = DrawnSampler(0)

    print(
        f"model {args.model.name}, {runtime.threads} threads, context {args.context}, "
        f"{args.steps} tokens per branch, median of {args.repeats}"
    )
    print(f"{'b':>3} {'separate ms':>12} {'batched ms':>11} {'batched/separate':>17} {'1/b':>5}")
    rows = []
    for branches in args.branches:

        def separate(b=branches):
            for _ in range(b):
                runtime.draft(args.steps, params, sampler)

        def batched(b=branches):
            runtime.draft(args.steps, params, sampler, branches=b)

        separate_ms = timed_ms(separate, args.repeats)
        batched_ms = timed_ms(batched, args.repeats)
        ratio = batched_ms[0] / separate_ms[0]
        rows.append(
            {
                "branches": branches,
                "separate_ms": separate_ms,
                "batched_ms": batched_ms,
                "ratio": round(ratio, 3),
            }
        )
        print(
            f"{branches:>3} {separate_ms[0]:>12.2f} {batched_ms[0]:>11.2f} {ratio:>17.2f} "
            f"{1 / branches:>5.2f}",
            flush=True,
        )
    runtime.discard_pending()
    if args.json:
        meta = {
            "model": str(args.model),
            "threads": runtime.threads,
            "context": args.context,
            "steps": args.steps,
            "repeats": args.repeats,
        }
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

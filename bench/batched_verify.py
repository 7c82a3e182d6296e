"""``python -m hetspec.bench.batched_verify``: k sequences' drafts verified in one native
forward against k forwards, one a sequence (issue #72's premise, measured at the runtime level).

    python -m hetspec.bench.batched_verify [--models bundled,smollm2] [--sequences 1,2,4,8]
        [--widths 1,5] [--prefix 128] [--passes 7] [--threads 2] [--worker]

For each model it opens the most sequences asked for in one ``NativeSequences`` (a range of
one cache each), prefills each with ``--prefix`` random tokens, and then, for every k and w,
times one ``evaluate`` of k chains of w tokens (one a sequence) against k ``evaluate_tree``
calls of the same chains, alternating which goes first, pass by pass over every (k, w), and
checks that both give the same logits bit for bit. Prints a markdown table of medians over
``--passes`` passes with their spread (min-max), the load average before and after (the
figures are only as quiet as the machine), and the KV cache's size a slot.

Models: ``bundled`` (the demo target, Q8_0), ``smollm2`` (SmolLM2-135M-Instruct, Q4_1, from the
cache where ``hetspec.models.smollm2`` put it; skipped with the reason where it cannot be had),
``heavy-100m`` / ``heavy-300m`` (Q8_0, made in the cache when absent), or a GGUF path.

``--worker`` measures the same through a real native worker process instead (the daemon's
``WorkerClient``, a worker loaded with ``Load.sequences`` = the most sequences asked): k
``VerifyTree``s (``argmax_only``, one chain of w tokens a sequence) posted at once, which the
worker takes together where they are queued when it reads them, against the same k sent one
by one, each after the last one's reply; the wall time of all k replies, the worker's own
``elapsed_ms`` (summed over the batches it ran), and how many commands shared a batch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from hetspec.arguments import positive, positive_list
from hetspec.speculative.verify.tree import chain_parents
from hetspec.workers.runtimes.native_sequences import NativeSequences, Tree

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "target" / "target-q8_0.gguf"


def model_path(name: str) -> Path:
    """The GGUF file a ``--models`` name stands for; ``LookupError`` with the reason where it
    cannot be had."""
    if name == "bundled":
        return BUNDLED
    if name == "smollm2":
        from hetspec.models.smollm2 import RealModelError, ensure_smollm2  # noqa: PLC0415

        try:
            return ensure_smollm2(quiet=True).gguf
        except RealModelError as error:
            raise LookupError(str(error)) from None
    if name.startswith("heavy-"):
        from hetspec.models.heavy import HeavyModelError, ensure_heavy  # noqa: PLC0415

        try:
            return ensure_heavy(name.removeprefix("heavy-"), ["q8_0"], None).gguf("q8_0")
        except HeavyModelError as error:
            raise LookupError(str(error)) from None
    if Path(name).is_file():
        return Path(name)
    raise LookupError(f"{name}: not bundled, smollm2, heavy-SIZE nor a file")


def timed(call) -> tuple[float, object]:
    """Milliseconds ``call`` took, and what it returned."""
    start = time.perf_counter()
    value = call()
    return (time.perf_counter() - start) * 1000, value


def measure_model(
    path: Path, sequences: list[int], widths: list[int], *, prefix: int, passes: int, threads: int
) -> dict:
    """{(k, w): (together ms per pass, separately ms per pass)} and the cache's bytes a slot."""
    context = prefix + max(widths) + 1
    most = max(sequences)
    batch = NativeSequences.load(path, most * context, threads=threads)
    rng = np.random.default_rng(0)
    vocab = batch.model.vocab
    opened = [batch.open(context) for _ in range(most)]
    for sequence in opened:
        sequence.prefill(rng.integers(0, vocab, prefix).tolist())
    work = {  # (k, w) -> k chains of w tokens, one a sequence
        (k, w): [
            Tree(sequence, rng.integers(0, vocab, w).tolist(), chain_parents(w))
            for sequence in opened[:k]
        ]
        for w in widths
        for k in sequences
    }
    figures = {cell: ([], []) for cell in work}
    # pass by pass over every cell, so that a burst of the machine's other work spreads over
    # the cells' passes instead of spoiling one cell's; the first pass warms up, uncounted
    for index in range(passes + 1):
        for (k, w), items in work.items():

            def together(items=items):
                return batch.evaluate(items)

            def separately(items=items):
                return [item.sequence.evaluate_tree(item.tokens, item.parents) for item in items]

            order = (together, separately) if index % 2 else (separately, together)
            results = {call: timed(call) for call in order}
            (together_ms, ours), (separately_ms, theirs) = results[together], results[separately]
            if not all(map(np.array_equal, ours, theirs)):
                raise AssertionError(f"k={k} w={w}: rows differ together and on their own")
            if index:
                figures[(k, w)][0].append(together_ms)
                figures[(k, w)][1].append(separately_ms)
    model = batch.model
    slot_bytes = 2 * model.keys[:, :, 0].nbytes  # keys and values
    return {"figures": figures, "slot_bytes": slot_bytes, "context": context}


async def measure_worker(
    path: Path, sequences: list[int], widths: list[int], *, prefix: int, passes: int, threads: int
) -> dict:
    """{(k, w): ((together wall ms, worker ms, commands a batch), (one by one wall ms, worker
    ms))} per pass, through a native worker process serving max(sequences) sequences."""
    import tempfile  # noqa: PLC0415 - the worker mode alone starts a process

    from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerSpec  # noqa: PLC0415
    from hetspec.protocol import worker_messages as m  # noqa: PLC0415

    context = prefix + max(widths) + 1
    most = max(sequences)
    cores = tuple(sorted(os.sched_getaffinity(0))[:threads])
    spec = WorkerSpec(
        name="target",
        runtime="native",
        model=str(path),
        settings=m.NativeSettings(n_ctx=context, threads=threads),
        cores=cores,
        log_format="console",
        sequences=most,
    )
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as run_dir:
        client = WorkerClient(spec, Path(run_dir), generation=1)
        ready = await client.start(120)
        if ready.sequences < most:
            raise AssertionError(f"the worker serves {ready.sequences} sequences, not {most}")
        try:
            vocab = len(ready.token_bytes)
            for sequence in range(most):
                tokens = rng.integers(0, vocab, prefix).tolist()
                await client.call(m.Prefill(client.next_request(), tokens, sequence=sequence))
            figures = {(k, w): ([], []) for w in widths for k in sequences}
            for index in range(passes + 1):
                for (k, w), (together, separately) in figures.items():
                    chains = [rng.integers(0, vocab, w).tolist() for _ in range(k)]

                    def commands(chains=chains, w=w):
                        return [
                            m.VerifyTree(
                                client.next_request(),
                                chain,
                                chain_parents(w).tolist(),
                                out=-1,
                                argmax_only=True,
                                sequence=sequence,
                            )
                            for sequence, chain in enumerate(chains)
                        ]

                    async def posted(commands=commands):
                        sent = [client.post(command) for command in commands()]
                        return [reply for reply, _ in await asyncio.gather(*sent)]

                    async def one_by_one(commands=commands):
                        return [(await client.call(command))[0] for command in commands()]

                    order = (posted, one_by_one) if index % 2 else (one_by_one, posted)
                    results = {}
                    for call in order:
                        start = time.perf_counter()
                        replies = await call()
                        results[call] = ((time.perf_counter() - start) * 1000, replies)
                    (ours_ms, ours), (theirs_ms, theirs) = results[posted], results[one_by_one]
                    if [r.argmax for r in ours] != [r.argmax for r in theirs]:
                        raise AssertionError(f"k={k} w={w}: argmax differ together and alone")
                    if index:  # a batch's replies share its elapsed_ms
                        batches = {reply.elapsed_ms for reply in ours}
                        together.append((ours_ms, sum(batches), k / len(batches)))
                        separately.append((theirs_ms, sum(r.elapsed_ms for r in theirs)))
        finally:
            await client.stop()
    return {"figures": figures}


def worker_table(name: str, measured: dict, *, prefix: int, passes: int) -> str:
    lines = [
        f"\n### {name}, through a worker process: k sequences' chains of w tokens after "
        f"{prefix} tokens each (ms, median of {passes} passes, min-max)\n",
        "| k | w | posted at once: wall | worker | commands a batch | one by one: wall "
        "| worker | wall, one by one / at once |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (k, w), (together, separately) in measured["figures"].items():
        ratio = statistics.median(t[0] for t in separately) / statistics.median(
            t[0] for t in together
        )
        lines.append(
            f"| {k} | {w} | {spread([t[0] for t in together])} | "
            f"{spread([t[1] for t in together])} | {spread([t[2] for t in together])} | "
            f"{spread([t[0] for t in separately])} | {spread([t[1] for t in separately])} | "
            f"{ratio:.2f}x |"
        )
    return "\n".join(lines)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(name: str, measured: dict, *, prefix: int, passes: int) -> str:
    lines = [
        f"\n### {name}: k sequences x w rows after {prefix} tokens each "
        f"(ms, median of {passes} passes, min-max)\n",
        "| k | w | rows | one forward | k forwards | k forwards / one | one forward / T(w) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    figures = measured["figures"]
    for (k, w), (together, separately) in figures.items():
        one = statistics.median(figures.get((1, w), (together,))[0])
        ratio = statistics.median(separately) / statistics.median(together)
        lines.append(
            f"| {k} | {w} | {k * w} | {spread(together)} | {spread(separately)} | "
            f"{ratio:.2f}x | {statistics.median(together) / one:.2f} |"
        )
    kib = measured["slot_bytes"] / 1024
    lines.append(
        f"\nKV cache: {kib:.1f} KiB a slot (keys and values, every layer): a sequence of "
        f"{measured['context']} tokens {kib * measured['context'] / 1024:.2f} MiB."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.batched_verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", default="bundled,smollm2", help="(default bundled,smollm2)")
    parser.add_argument("--sequences", type=positive_list, default=[1, 2, 4, 8])
    parser.add_argument("--widths", type=positive_list, default=[1, 5])
    parser.add_argument("--prefix", type=positive, default=128, help="tokens before (128)")
    parser.add_argument("--passes", type=positive, default=7, help="timed passes (7)")
    parser.add_argument("--threads", type=positive, default=2, help="threads (2)")
    parser.add_argument(
        "--worker", action="store_true", help="through a native worker process (see above)"
    )
    args = parser.parse_args(argv)
    if args.threads > len(os.sched_getaffinity(0)):
        parser.error(f"{args.threads} threads but this process runs on fewer cores")
    print(f"load average before: {os.getloadavg()[0]:.2f}, threads {args.threads}")
    for name in (part.strip() for part in args.models.split(",") if part.strip()):
        try:
            path = model_path(name)
        except LookupError as error:
            print(f"\n### {name}: skipped ({error})")
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        if args.worker:
            measured = asyncio.run(
                measure_worker(
                    path,
                    sorted(args.sequences),
                    sorted(args.widths),
                    prefix=args.prefix,
                    passes=args.passes,
                    threads=args.threads,
                )
            )
            title = f"{name} ({path.name})"
            print(worker_table(title, measured, prefix=args.prefix, passes=args.passes))
            continue
        measured = measure_model(
            path,
            sorted(args.sequences),
            sorted(args.widths),
            prefix=args.prefix,
            passes=args.passes,
            threads=args.threads,
        )
        print(table(f"{name} ({path.name})", measured, prefix=args.prefix, passes=args.passes))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

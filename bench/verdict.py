"""Micro-benchmark: a sampled round's verification, its verdict walked by the daemon or by
the verifier (``VerifyTree.walk``).

    python -m hetspec.bench.verdict MODEL [--runtime native] [--nodes 16]
        [--rounds 40] [--temperature 0.8] [--top-p 1.0] [--json PATH]

Starts a real verifier worker (MODEL: a GGUF for native or llama.cpp, a folder for torch)
and verifies one chain of ``--nodes`` drafted tokens below a bonus, over and over at the same
place, for a seeded (keyed) request, in two ways alternated round by round:
- ``daemon walks``: the verifier writes every row's logits to an arena slot and the daemon
  takes the verdict from them (``verify_sampled``), as it does with log-probabilities asked;
- ``verifier walks``: the verifier takes the verdict itself, reading only the rows its walk
  reaches, and replies the path and the bonus.
Two drafts: the target's own keyed tokens (every node accepted: the walk reads every row)
and the same chain with its first token changed (rejected at once: the walk reads one row).
Times are per round as the daemon sees it (the call and the verdict), medians over the rounds
after the first few, and the verifier's own share (its ``elapsed_ms``). Each round's verdict
is checked against the other way's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerSpec, WorkerStartError
from hetspec.protocol import Arena
from hetspec.protocol import worker_messages as m
from hetspec.speculative.verify.samplers import KeyedSampler
from hetspec.speculative.verify.verdicts import verify_sampled

SEED = 1234
WARM_UP = 3  # rounds per way not counted: caches, the allocator, a runtime's first shapes


def settings_for(runtime: str, threads: int, context: int, nodes: int):
    if runtime == "native":
        return m.NativeSettings(n_ctx=context, threads=threads)
    if runtime == "llama.cpp":
        return m.LlamaCppSettings(
            n_ctx=context, threads=threads, threads_batch=threads, n_batch=max(64, nodes + 1)
        )
    return m.TorchSettings(max_context=context, threads=threads)


async def run(args: argparse.Namespace) -> int:
    cores = sorted(os.sched_getaffinity(0))
    threads = args.threads or max(1, len(cores) - 1)
    worker_cores = tuple(cores[-threads:])
    if len(cores) > threads:  # as in the daemon: the worker owns its cores, the daemon the rest
        os.sched_setaffinity(0, cores[:-threads])
    spec = WorkerSpec(
        "gpu",
        args.runtime,
        str(args.model),
        settings_for(args.runtime, threads, args.context, args.nodes),
        cores=worker_cores,
        log_format="console",
    )
    with tempfile.TemporaryDirectory(prefix="hetspec-bench-") as runtime_dir:
        name = f"/dev/shm/hetspec-bench-{os.getpid()}"
        # the slot's size is known once the worker says its vocabulary: a probe worker first
        probe = WorkerClient(spec, Path(runtime_dir), 1)
        try:
            await probe.start(load_timeout_s=600)
        except WorkerStartError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        vocab = probe.ready.vocab.size
        await probe.stop()
        with Arena.create(name, slots=1, slot_bytes=(args.nodes + 1) * vocab * 4) as arena:
            client = WorkerClient(spec, Path(runtime_dir), 2, arena.layout)
            await client.start(load_timeout_s=600)
            try:
                results = await time_rounds(client, arena, vocab, args)
            finally:
                await client.stop()
    sampling = f"temperature {args.temperature:g}" + (
        f", top-p {args.top_p:g}" if args.top_p < 1 else ""
    )
    print(
        f"{args.runtime} verifier on {threads} thread(s), vocabulary {vocab}, a chain of "
        f"{args.nodes} drafted tokens below the bonus, keyed sampling at {sampling}; "
        f"ms a round as the daemon sees it (the call and the verdict), median of "
        f"{args.rounds - WARM_UP} rounds a way, alternated; in brackets the verifier's "
        f"own"
    )
    print(f"  {'draft':<28} {'daemon walks':>20} {'verifier walks':>20} {'saved':>8}")
    for draft, ways in results.items():
        daemon, verifier = ways["daemon walks"], ways["verifier walks"]
        print(
            f"  {draft:<28} {daemon['round_ms']:8.3f} ({daemon['worker_ms']:7.3f}) "
            f"{verifier['round_ms']:8.3f} ({verifier['worker_ms']:7.3f}) "
            f"{daemon['round_ms'] - verifier['round_ms']:8.3f}"
        )
    if args.json is not None:
        document = {
            "runtime": args.runtime,
            "vocab": vocab,
            "nodes": args.nodes,
            "threads": threads,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "results": results,
        }
        args.json.write_text(json.dumps(document, indent=1))
    return 0


async def time_rounds(client: WorkerClient, arena: Arena, vocab: int, args) -> dict:
    params = m.SamplingParams(temperature=args.temperature, top_p=args.top_p)
    prompt = list(range(5, 5 + args.prompt))
    await client.call(m.Prefill(request=client.next_request(), tokens=prompt, seed=SEED))
    # the target's own keyed tokens after the prompt, then back to the prompt less its last
    # token, which each tree repeats as its bonus (row 0 chooses the token at len(prompt))
    decoded, _ = await client.call(
        m.Decode(request=client.next_request(), steps=args.nodes, sampling=params)
    )
    await client.call(m.Rollback(request=client.next_request(), length=len(prompt) - 1))
    own = decoded.tokens
    drafts = {
        "accepted whole (reads all)": own,
        "rejected at once (reads one)": [(own[0] + 1) % vocab, *own[1:]],
    }
    parents = list(range(-1, args.nodes))
    position, sampler = len(prompt), KeyedSampler(SEED)
    walk = m.SampledWalk(params, position, keyed=True)
    results: dict[str, dict] = {}
    for label, draft in drafts.items():
        tree = [prompt[-1], *draft]
        draft_parents = list(range(-1, len(draft) - 1))
        samples: dict[str, list[tuple[float, float]]] = {"daemon walks": [], "verifier walks": []}
        for index in range(args.rounds):
            verdicts = {}
            for way, times in samples.items():
                start = time.perf_counter()
                command = m.VerifyTree(
                    request=client.next_request(),
                    tokens=tree,
                    parents=parents,
                    out=0,
                    walk=walk if way == "verifier walks" else None,
                )
                verified, _ = await client.call(command)
                if verified.logits is None:
                    verdict = (verified.path, verified.bonus)
                else:
                    rows = arena.view(verified.logits)
                    taken = verify_sampled(
                        draft, draft_parents, rows, params, position=position, keyed=sampler
                    )
                    verdict = (taken.path, taken.bonus)
                seconds = time.perf_counter() - start
                verdicts[way] = verdict
                if index >= WARM_UP:
                    times.append((seconds * 1000, verified.elapsed_ms))
            if verdicts["daemon walks"] != verdicts["verifier walks"]:
                raise AssertionError(f"the two verdicts differ: {verdicts}")
        results[label] = {
            way: {
                "round_ms": round(statistics.median(t for t, _ in times), 3),
                "worker_ms": round(statistics.median(w for _, w in times), 3),
                "accepted": len(verdicts[way][0]),
            }
            for way, times in samples.items()
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.verdict", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("model", type=Path, help="a GGUF (native, llama.cpp) or folder (torch)")
    parser.add_argument("--runtime", choices=["native", "llama.cpp", "torch"], default="native")
    parser.add_argument("--nodes", type=int, default=16, help="drafted tokens in the chain")
    parser.add_argument("--rounds", type=int, default=40, help="rounds a way and draft")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens before the chain")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, help="the verifier's (default: all cores but one)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.rounds <= WARM_UP:
        parser.error(f"--nodes must be >= 1 and --rounds > {WARM_UP}")
    cores = os.sched_getaffinity(0)
    try:
        return uvloop.run(run(args))
    finally:
        os.sched_setaffinity(0, cores)


if __name__ == "__main__":
    sys.exit(main())

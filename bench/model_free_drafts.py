"""``python -m hetspec.bench.model_free_drafts``: what the model-free drafters cost at 8k tokens
of context, and what greedy verification would accept of their proposals.

    python -m hetspec.bench.model_free_drafts [--context 8192] [--budget 16] [--nodes 16]
        [--rounds 300] [--repeats 5]

Three token streams (the bundled demo tokenizer, a Python-code BPE, tokenizes the code):
- ``python source``: hetspec's own sources, file after file; --context tokens are the prompt,
  the rounds replay the files that follow (new code, the repository's idioms repeating);
- ``rewrite a file``: the prompt ends with one file, the rounds replay that file with one
  token in 50 changed (a model asked to edit code it was given);
- ``one token``: --context copies of one token, and more of it.

For each drafter (fresh, fed the prompt at once) the rounds go as the engine's would: propose
a chain of --budget tokens (or a tree of --nodes nodes), accept the longest prefix (path) the
stream continues with, then ``extend`` with the accepted tokens and the stream's next one (the
bonus). Times are microseconds per call on one core, the median over a replay's rounds, then
over --repeats replays (the prompt's feed: milliseconds); ``tokens/round`` counts the bonus.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import hetspec.daemon
import hetspec.models
import hetspec.speculative
import hetspec.workers
from hetspec.arguments import positive
from hetspec.speculative.drafting.continuation_tree import ContinuationTree
from hetspec.speculative.drafting.model_free import Fallback, ModelFreeDrafter
from hetspec.speculative.drafting.ngram_table import NgramTable
from hetspec.speculative.drafting.prompt_lookup import PromptLookup
from hetspec.speculative.verify.tree import chain_parents, match_path

DRAFTERS: dict[str, Callable[[], ModelFreeDrafter]] = {
    "prompt lookup": PromptLookup,
    "continuation tree": ContinuationTree,
    "n-gram table": NgramTable,
    "lookup, else table": lambda: Fallback(PromptLookup(), NgramTable()),
}
EDIT_EVERY = 50  # the rewrite changes one token in this many


def source_tokens() -> tuple[list[list[int]], str]:
    """Token ids of hetspec's Python files, one list a file, and how they were tokenized."""
    files = [
        path
        for package in (hetspec.speculative, hetspec.daemon, hetspec.workers)
        for path in sorted(Path(package.__file__).parent.rglob("*.py"))
    ]
    texts = [path.read_text() for path in files]
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 - only the bench needs it

        models = Path(hetspec.models.__file__).parent
        tokenizer = Tokenizer.from_file(str(models / "target" / "tokenizer.json"))
        return [tokenizer.encode(text).ids for text in texts], "the demo target's tokenizer"
    except (ImportError, OSError):  # no tokenizer here: one token a byte still repeats as code
        return [list(text.encode()) for text in texts], "bytes (no tokenizer found)"


def streams(context: int) -> dict[str, tuple[list[int], list[int]]]:
    """Workload name -> (prompt, what the rounds replay)."""
    per_file, tokenized = source_tokens()
    flat = [token for tokens in per_file for token in tokens]
    if len(flat) < 2 * context:
        raise SystemExit(f"only {len(flat)} tokens of source: ask for a smaller --context")
    # the prompt's last file, rewritten: the first file ending at or after `context` tokens
    ends = np.cumsum([len(tokens) for tokens in per_file])
    last = int(np.searchsorted(ends, context))
    prompt = flat[: int(ends[last])][-context:]
    rewrite = [
        (token + 1) % 4096 if index % EDIT_EVERY == EDIT_EVERY - 1 else token
        for index, token in enumerate(per_file[last])
    ]
    print(f"streams: hetspec's sources tokenized with {tokenized}, {len(flat)} tokens\n")
    return {
        "python source": (flat[:context], flat[context:]),
        "rewrite a file": (prompt, rewrite),
        "one token": ([7] * context, [7] * (4 * context)),
    }


def replay(
    make: Callable[[], ModelFreeDrafter],
    prompt: list[int],
    stream: list[int],
    args: argparse.Namespace,
    tree: bool,
) -> dict[str, float]:
    """One replay: the prompt's feed (ms), per-call medians (µs), tokens committed a round."""
    drafter = make()
    start = time.perf_counter_ns()
    drafter.extend(prompt)
    feed_ms = (time.perf_counter_ns() - start) / 1e6
    propose_ns, extend_ns, committed = [], [], []
    position = 0
    for _ in range(args.rounds):
        if position >= len(stream):
            break
        start = time.perf_counter_ns()
        if tree:
            tokens, parents, _ = drafter.propose_tree(args.nodes)
        else:
            tokens = drafter.propose(args.budget)
        propose_ns.append(time.perf_counter_ns() - start)
        if not tree:
            parents = chain_parents(len(tokens)).tolist()
        # greedy verification: the longest path the stream goes on with, then its next token
        ahead = stream[position : position + 64]  # deeper than any proposal
        path = match_path(np.array(tokens, np.int64), np.array(parents, np.int64), ahead)
        commit = stream[position : position + len(path) + 1]
        start = time.perf_counter_ns()
        drafter.extend(commit)
        extend_ns.append(time.perf_counter_ns() - start)
        committed.append(len(commit))
        position += len(commit)
    return {
        "feed": feed_ms,
        "propose": statistics.median(propose_ns) / 1e3,
        "extend": statistics.median(extend_ns) / 1e3,
        "per_round": statistics.fmean(committed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=positive, default=8192, help="prompt tokens")
    parser.add_argument("--budget", type=positive, default=16, help="tokens a chain may propose")
    parser.add_argument("--nodes", type=positive, default=16, help="nodes a tree may propose")
    parser.add_argument("--rounds", type=positive, default=300)
    parser.add_argument("--repeats", type=positive, default=5)
    args = parser.parse_args(argv)
    header = (
        f"{'drafter':<20}{'feed ms':>9}{'propose µs':>12}{'tree µs':>9}{'extend µs':>11}"
        f"{'chain tok/round':>17}{'tree tok/round':>16}"
    )
    for workload, (prompt, stream) in streams(args.context).items():
        print(
            f"{workload}: {len(prompt)} tokens of prompt, chains of {args.budget}, trees of "
            f"{args.nodes} nodes, {args.rounds} rounds, medians of {args.repeats} replays"
        )
        print(header)
        for name, make in DRAFTERS.items():
            chains = [replay(make, prompt, stream, args, tree=False) for _ in range(args.repeats)]
            trees = [replay(make, prompt, stream, args, tree=True) for _ in range(args.repeats)]

            def median(runs: list[dict[str, float]], key: str) -> float:
                return statistics.median(run[key] for run in runs)

            print(
                f"{name:<20}{median(chains, 'feed'):>9.1f}{median(chains, 'propose'):>12.1f}"
                f"{median(trees, 'propose'):>9.1f}{median(chains, 'extend'):>11.1f}"
                f"{median(chains, 'per_round'):>17.2f}{median(trees, 'per_round'):>16.2f}"
            )
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

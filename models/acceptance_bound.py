"""How much a draft can be accepted on the bundled target: draft model against draft head.

    python -m hetspec.models.acceptance_bound [--prompts 8] [--tokens 96] [--gammas 4,8,16]
                                              [--head models/head] [--target-gguf GGUF]
                                              [--verify-ms 2.6,1.8,1.0 [--draft-ms 0.15]
                                               [--other-ms 0.3]
                                               [--stop-below 0.05,0.1]] [--out FILE.md]

Offline, in torch float32, on the benchmarks' prompts (``corpus.prompt_set``): the target's
own greedy continuation of each prompt, then, at every generated position, whether each
drafter's first choice is the target's (the draft model over the true tokens; the head
drafting k steps from its own features, as a chain's k-th node is drafted). Walking each
continuation in rounds of gamma gives the mean drafted tokens a greedy chain keeps per round:
what the daemon's rounds would keep with a verifier that computes as this one does. The
ceiling for a drafter that agrees with the target with probability a at every step is
a (1 - a^gamma) / (1 - a) tokens; the last table gives the agreement a head would need for a
given multiple of the draft model's chain. With ``--verify-ms`` it also says what plain
(not overlapped) rounds of the draft model's chains allow for those verification costs as the
daemon sees them, with a draft token's and the rest of a round's: the best gamma and its
tokens a second (e.g. the GPU box's costs, docs/bench/gpu); with ``--stop-below`` also rounds
that stop drafting once the draft model's top probability falls below a threshold (llama.cpp's
``p_min`` idea) against that best fixed gamma. With ``--target-gguf`` the
target's continuation and the features the head reads come from llama.cpp over that file
instead (as the daemon's draft-gpu verifier computes them, e.g. the bundled Q8_0 export).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from hetspec.models.corpus import prompt_set
from hetspec.models.train_head import Teacher, shifted
from hetspec.workers.runtimes.torch_runtime.draft_head import load_head, load_target_pieces
from hetspec.workers.runtimes.torch_runtime.model import rope_tables

MODELS = Path(__file__).parent
CPU = torch.device("cpu")


def greedy_continuation(target: Teacher, prompt: list[int], count: int) -> torch.Tensor:
    tokens = torch.tensor(prompt)
    for _ in range(count):
        _, log_p = target(tokens.view(1, -1))
        tokens = torch.cat([tokens, log_p[0, -1].argmax().view(1)])
    return tokens


def gguf_continuation(path: Path, prompt: list[int], count: int) -> tuple[torch.Tensor, ...]:
    """The target's greedy continuation in llama.cpp, and the features of every position."""
    from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415

    # the daemon's verifier settings: no flash attention, an f32 V cache
    runtime = LlamaCppRuntime(
        path, n_ctx=len(prompt) + count + 1, flash_attention="off", v_type="f32"
    )
    try:
        runtime.prefill(prompt)
        tokens = list(prompt)
        for _ in range(count):
            tokens.append(int(np.argmax(runtime.last_logits())))
            runtime.append(tokens[-1:])
        runtime.rollback(0)
        with runtime.features_captured() as rows:
            runtime.append(tokens)
        features = torch.from_numpy(np.concatenate(rows))[None]
    finally:
        runtime.close()
    return torch.tensor(tokens), features


def chain_kept(agrees: list[np.ndarray], first: int, end: int, gamma: int) -> tuple[int, int]:
    """(tokens kept, rounds) walking positions first..end in greedy chain rounds:
    ``agrees[k][t]``: the drafter's (k+1)-th chain node, drafted at position t, is the
    target's choice there."""
    kept = rounds = 0
    position = first
    while position + gamma <= end:
        accepted = 0
        while accepted < gamma and agrees[min(accepted, len(agrees) - 1)][position + accepted]:
            accepted += 1
        kept, rounds, position = kept + accepted, rounds + 1, position + accepted + 1
    return kept, rounds


def confident_walk(
    agrees: np.ndarray, confidence: np.ndarray, first: int, end: int, *, most: int, below: float
) -> tuple[int, int, int]:
    """(tokens kept, rounds, draft forwards) walking positions first..end in plain rounds
    that draft until the drafter's top probability falls below ``below`` (a node at least,
    ``most`` at most): ``confidence[t]``, the draft model's top probability at position t.
    A round stopped that way paid one forward more, the one whose choice it did not draft."""
    kept = rounds = forwards = 0
    position = first
    while position + most <= end:
        drafted = 1
        while drafted < most and confidence[position + drafted] >= below:
            drafted += 1
        accepted = 0
        while accepted < drafted and agrees[position + accepted]:
            accepted += 1
        forwards += drafted + (drafted < most)
        kept, rounds, position = kept + accepted, rounds + 1, position + accepted + 1
    return kept, rounds, forwards


def best_plain_round(
    kept: dict[int, float], verify_ms: float, draft_ms: float, other_ms: float
) -> tuple[int, float]:
    """(gamma, tokens a second) of the fastest plain round: ``kept[g]``, the drafted tokens a
    chain of g keeps a round; a round costs g drafts, one verification and the rest, and
    yields what it keeps plus the target's own token."""
    rates = {g: 1000 * (k + 1) / (g * draft_ms + verify_ms + other_ms) for g, k in kept.items()}
    gamma = max(rates, key=rates.__getitem__)
    return gamma, rates[gamma]


def ceiling(agreement: float, gamma: int) -> float:
    return agreement * (1 - agreement**gamma) / (1 - agreement)


def needed_agreement(kept: float, gamma: int) -> float | None:
    """The per-step agreement whose chain of gamma keeps ``kept`` tokens (None: > gamma)."""
    if kept >= gamma:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if ceiling(middle, gamma) < kept else (low, middle)
    return low


class Drafters:
    """The target, the draft model and the head, as the measurement reads them."""

    def __init__(self, head: Path) -> None:
        # Teacher runs any model folder whole-sequence: the draft model's choices too
        self.target, self.draft = Teacher(MODELS / "target"), Teacher(MODELS / "draft")
        limit = self.target.config.max_context
        self.pieces = load_target_pieces(self.target.config, MODELS / "target", torch.float32, CPU)
        self.head = load_head(head, self.target.config, torch.float32, CPU)
        self.head_rope = rope_tables(self.head.config.block_config(), limit, CPU)
        self.tokenizer = Tokenizer.from_file(str(MODELS / "target" / "tokenizer.json"))

    @torch.no_grad()
    def agreements(self, prompt: str, tokens_out: int, depth: int, gguf: Path | None):
        """(first, end, the draft model's agreement, the head's per chain step, the draft
        model's top probability): position t agrees when the drafter's first choice there is
        the target's."""
        ids = self.tokenizer.encode(prompt).ids
        if gguf is None:
            tokens = greedy_continuation(self.target, ids, tokens_out)
            features, log_p = self.target(tokens.view(1, -1))
            choice = log_p[0].argmax(-1)  # the target's next token at each position
        else:  # greedy: the next token is the choice (the last position's is never read)
            tokens, features = gguf_continuation(gguf, ids, tokens_out)
            choice = torch.cat([tokens[1:], tokens[-1:]])
        _, draft_log_p = self.draft(tokens.view(1, -1))
        draft = (draft_log_p[0].argmax(-1) == choice).numpy()
        confidence = draft_log_p[0].max(-1).values.exp().numpy()
        head, inputs, n = [], shifted(features), len(tokens)
        embeddings = self.pieces.embed(tokens.view(1, -1))
        cos, sin = (table[:n] for table in self.head_rope)
        for _ in range(depth):  # step k reads step k - 1's predicted features
            predicted = self.pieces.feature(self.head.sequences(inputs, embeddings, cos, sin))
            head.append((self.pieces.logits(predicted)[0].argmax(-1) == choice).numpy())
            inputs = shifted(predicted)
        return len(ids) - 1, len(tokens) - 1, draft, head, confidence


def report(rate: dict, kept: dict, gammas: list[int], source: str, args) -> str:
    depth = max(gammas)
    lines = [
        f"# Greedy acceptance on the bundled target ({args.prompts} prompts x "
        f"{args.tokens} tokens, {source})\n",
        "| drafter | agreement per step |",
        "|---|---|",
    ]
    shown = ("draft model", "head, step 1", "head, step 2", f"head, step {depth}")
    lines += [f"| {key} | {value:.3f} |" for key, value in rate.items() if key in shown]
    lines += [
        "",
        "| gamma | draft model kept/round | head kept/round | head / draft model | "
        "head agreement needed for 1.5x |",
        "|---|---|---|---|---|",
    ]
    for g in gammas:
        base = kept["draft model", g][0] / kept["draft model", g][1]
        ours = kept["head", g][0] / kept["head", g][1]
        needed = needed_agreement(1.5 * base, g)
        need = "impossible (> gamma)" if needed is None else f"{needed:.3f}"
        lines.append(f"| {g} | {base:.2f} | {ours:.2f} | {ours / base:.2f}x | {need} |")
    a = rate["draft model"]
    lines += [
        "",
        f"A chain of any length keeps at most a / (1 - a) tokens: {a / (1 - a):.1f} "
        f"for the draft model's {a:.3f}; 1.5x that needs a head agreeing "
        f"{1.5 * a / (1 + 0.5 * a):.3f} at every step.",
    ]
    return "\n".join(lines)


def round_costs_report(
    kept: dict[int, float], costs: list[float], draft_ms: float, other_ms: float
) -> str:
    lines = [
        f"Plain rounds of the draft model's chains (gamma 1..{max(kept)}), a draft token "
        f"{draft_ms} ms, the rest of a round {other_ms} ms:",
        "",
        "| verification ms | best gamma | kept a round | tokens/s |",
        "|---|---|---|---|",
    ]
    for verify_ms in costs:
        gamma, rate = best_plain_round(kept, verify_ms, draft_ms, other_ms)
        lines.append(f"| {verify_ms} | {gamma} | {kept[gamma]:.2f} | {rate:.0f} |")
    return "\n".join(lines)


STOP_MOST = (8, 12, 16)  # the longest drafts a stopping rule may reach


def stop_below_report(
    walks: dict, kept: dict[int, float], costs: list[float], draft_ms: float, other_ms: float
) -> str:
    """Plain rounds that stop drafting below a confidence against the best fixed gamma:
    ``walks[(below, most)]`` = (kept, rounds, forwards) summed over the prompts."""
    thresholds = sorted({below for below, _ in walks})
    lines = [
        f"Plain rounds that draft until the draft model's top probability falls below a "
        f"threshold (at most {'/'.join(map(str, STOP_MOST))} nodes, the best of them; "
        f"a stopped round pays the forward it did not draft), against the best fixed "
        f"gamma; a draft forward {draft_ms} ms, the rest of a round {other_ms} ms:",
        "",
        "| verification ms | best fixed gamma, tokens/s | "
        + " | ".join(f"below {t}" for t in thresholds)
        + " |",
        "|---|---|" + "---|" * len(thresholds),
    ]
    for verify_ms in costs:
        gamma, fixed = best_plain_round(kept, verify_ms, draft_ms, other_ms)
        cells = []
        for below in thresholds:
            rates = {}
            for most in STOP_MOST:
                hit, rounds, forwards = walks[below, most]
                seconds = forwards * draft_ms + rounds * (verify_ms + other_ms)
                rates[most] = 1000 * (hit + rounds) / seconds
            most = max(rates, key=rates.__getitem__)
            cells.append(f"{rates[most]:.0f} ({rates[most] / fixed:.2f}x, at most {most})")
        lines.append(f"| {verify_ms} | {fixed:.0f} (gamma {gamma}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.models.acceptance_bound")
    parser.add_argument("--prompts", type=int, default=8, help="code prompts (as bench_head)")
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens per prompt")
    parser.add_argument("--gammas", default="4,8,16")
    parser.add_argument("--head", type=Path, default=MODELS / "head")
    parser.add_argument(
        "--target-gguf",
        type=Path,
        default=None,
        help="the target's text and features from llama.cpp over this file",
    )
    parser.add_argument(
        "--verify-ms",
        default=None,
        help="comma-separated verification costs (ms, as the daemon sees "
        "them): what plain rounds of the draft model allow at each",
    )
    parser.add_argument("--draft-ms", type=float, default=0.15, help="a draft token's ms")
    parser.add_argument(
        "--other-ms",
        type=float,
        default=0.3,
        help="the rest of a round's ms (links, the daemon's own)",
    )
    parser.add_argument(
        "--stop-below",
        default=None,
        help="with --verify-ms: comma-separated confidences; also what plain "
        "rounds drafting until the draft's top probability falls below each "
        "allow",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args(argv)
    gammas = [int(g) for g in args.gammas.split(",")]
    depth = max(gammas)
    costs = [float(ms) for ms in args.verify_ms.split(",")] if args.verify_ms else []
    walked = sorted(set(gammas) | (set(range(1, depth + 1)) if costs else set()))
    drafters = Drafters(args.head)
    kept = {(name, g): [0, 0] for name in ("draft model", "head") for g in walked}
    agreement = {"draft model": [0, 0], **{f"head, step {k + 1}": [0, 0] for k in range(depth)}}
    stops = [float(t) for t in args.stop_below.split(",")] if args.stop_below and costs else []
    walks = {(below, most): np.zeros(3, int) for below in stops for most in STOP_MOST}
    for prompt in prompt_set(args.prompts)[: args.prompts]:
        first, end, draft, head, confidence = drafters.agreements(
            prompt, args.tokens, depth, args.target_gguf
        )
        for name, agrees in (("draft model", [draft]), ("head", head)):
            for g in walked:
                got = chain_kept(agrees, first, end, g)
                kept[name, g] = [kept[name, g][0] + got[0], kept[name, g][1] + got[1]]
        for below, most in walks:
            walks[below, most] += confident_walk(
                draft, confidence, first, end, most=most, below=below
            )
        steps = [(f"head, step {k + 1}", a) for k, a in enumerate(head)]
        for key, agrees in [("draft model", draft), *steps]:
            agreement[key][0] += int(agrees[first:end].sum())
            agreement[key][1] += end - first
    rate = {key: hit / total for key, (hit, total) in agreement.items()}
    source = "torch f32" if args.target_gguf is None else f"llama.cpp, {args.target_gguf.name}"
    text = report(rate, kept, gammas, source, args)
    if costs:
        per_round = {
            g: hit / rounds for (name, g), (hit, rounds) in kept.items() if name == "draft model"
        }
        text += "\n\n" + round_costs_report(per_round, costs, args.draft_ms, args.other_ms)
        if walks:
            text += "\n\n" + stop_below_report(
                walks, per_round, costs, args.draft_ms, args.other_ms
            )
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

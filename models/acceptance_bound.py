"""How much a draft can be accepted on the bundled target: draft model against draft head.

    python -m hetspec.models.acceptance_bound [--prompts 8] [--tokens 96] [--gammas 4,8,16]
                                              [--head models/head] [--out FILE.md]

Offline, in torch float32, on the benchmarks' prompts (``corpus.prompt_set``): the target's
own greedy continuation of each prompt, then, at every generated position, whether each
drafter's first choice is the target's (the draft model over the true tokens; the head
drafting k steps from its own features, as a chain's k-th node is drafted). Walking each
continuation in rounds of gamma gives the mean drafted tokens a greedy chain keeps per round:
what the daemon's rounds would keep with a verifier that computes as this one does. The
ceiling for a drafter that agrees with the target with probability a at every step is
a (1 - a^gamma) / (1 - a) tokens; the last table gives the agreement a head would need for a
given multiple of the draft model's chain.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from hetspec.models.corpus import prompt_set
from hetspec.models.train_head import Teacher, shifted
from hetspec.workers.torch_runtime.config import ModelConfig
from hetspec.workers.torch_runtime.draft_head import load_head, load_target_pieces
from hetspec.workers.torch_runtime.model import rope_tables
from hetspec.workers.torch_runtime.weights import load_model

MODELS = Path(__file__).parent
CPU = torch.device("cpu")


class Causal:
    """A model folder's whole-sequence logits (no cache kept between calls): the draft model."""

    def __init__(self, folder: Path) -> None:
        self.config = ModelConfig.from_folder(folder)
        self.model = load_model(folder, self.config, torch.float32, CPU)
        self.cos, self.sin = rope_tables(self.config, self.config.max_context, CPU)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        c, n = self.config, len(tokens)
        shape = (c.num_layers, c.num_kv_heads, n, c.head_dim)
        causal = [torch.ones(n, n, dtype=torch.bool).tril()] * c.num_layers
        hidden = self.model(tokens, self.cos[:n], self.sin[:n], cache_keys=torch.zeros(shape),
                            cache_values=torch.zeros(shape), start=0, masks=causal)  # fmt: skip
        return F.linear(self.model.model.norm(hidden), self.model.head_weight())


def greedy_continuation(target: Teacher, prompt: list[int], count: int, rope) -> torch.Tensor:
    tokens = torch.tensor(prompt)
    for _ in range(count):
        _, log_p = target(tokens.view(1, -1), *rope)
        tokens = torch.cat([tokens, log_p[0, -1].argmax().view(1)])
    return tokens


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.models.acceptance_bound")
    parser.add_argument("--prompts", type=int, default=8, help="code prompts (as bench_head)")
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens per prompt")
    parser.add_argument("--gammas", default="4,8,16")
    parser.add_argument("--head", type=Path, default=MODELS / "head")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args(argv)
    gammas = [int(g) for g in args.gammas.split(",")]
    depth = max(gammas)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    target, draft = Teacher(MODELS / "target"), Causal(MODELS / "draft")
    rope = rope_tables(target.config, target.config.max_context, CPU)
    pieces = load_target_pieces(target.config, MODELS / "target", torch.float32, CPU)
    head = load_head(args.head, target.config, torch.float32, CPU)
    head_cos, head_sin = rope_tables(head.config.block_config(), target.config.max_context, CPU)
    tokenizer = Tokenizer.from_file(str(MODELS / "target" / "tokenizer.json"))

    kept = {(name, g): [0, 0] for name in ("draft model", "head") for g in gammas}
    agreement = {"draft model": [0, 0], **{f"head, step {k + 1}": [0, 0] for k in range(depth)}}
    with torch.no_grad():
        for prompt in prompt_set(args.prompts)[: args.prompts]:
            ids = tokenizer.encode(prompt).ids
            tokens = greedy_continuation(target, ids, args.tokens, rope)
            features, log_p = target(tokens.view(1, -1), *rope)
            choice = log_p[0].argmax(-1)  # the target's next token at each position
            first, end = len(ids) - 1, len(tokens) - 1  # positions predicting generated tokens
            draft_agrees = (draft.logits(tokens).argmax(-1) == choice).numpy()
            head_agrees, inputs, n = [], shifted(features), len(tokens)
            embeddings = pieces.embed(tokens.view(1, -1))
            for _ in range(depth):  # step k reads step k - 1's predicted features
                predicted = pieces.feature(head.sequences(inputs, embeddings, head_cos[:n],
                                                          head_sin[:n]))  # fmt: skip
                head_agrees.append((pieces.logits(predicted)[0].argmax(-1) == choice).numpy())
                inputs = shifted(predicted)
            for name, agrees in (("draft model", [draft_agrees]), ("head", head_agrees)):
                for g in gammas:
                    got = chain_kept(agrees, first, end, g)
                    kept[name, g] = [kept[name, g][0] + got[0], kept[name, g][1] + got[1]]
            steps = [(f"head, step {k + 1}", a) for k, a in enumerate(head_agrees)]
            for key, agrees in [("draft model", draft_agrees), *steps]:
                agreement[key][0] += int(agrees[first:end].sum())
                agreement[key][1] += end - first

    rate = {key: hit / total for key, (hit, total) in agreement.items()}
    lines = [f"# Greedy acceptance on the bundled target ({args.prompts} prompts x "
             f"{args.tokens} tokens, torch f32)\n",
             "| drafter | agreement per step |", "|---|---|"]  # fmt: skip
    lines += [
        f"| {key} | {value:.3f} |"
        for key, value in rate.items()
        if key in ("draft model", "head, step 1", "head, step 2", f"head, step {depth}")
    ]
    lines += ["", "| gamma | draft model kept/round | head kept/round | head / draft model | "
              "head agreement needed for 1.5x |", "|---|---|---|---|---|"]  # fmt: skip
    for g in gammas:
        base = kept["draft model", g][0] / kept["draft model", g][1]
        ours = kept["head", g][0] / kept["head", g][1]
        needed = needed_agreement(1.5 * base, g)
        need = "impossible (> gamma)" if needed is None else f"{needed:.3f}"
        lines.append(f"| {g} | {base:.2f} | {ours:.2f} | {ours / base:.2f}x | {need} |")
    a = rate["draft model"]
    lines += ["", f"A chain of any length keeps at most a / (1 - a) tokens: {a / (1 - a):.1f} "
              f"for the draft model's {a:.3f}; 1.5x that needs a head agreeing "
              f"{1.5 * a / (1 + 0.5 * a):.3f} at every step."]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train the bundled target's draft head (Dovetail's DGF head, EAGLE-style features).

    python -m hetspec.models.train_head --out models/head --minutes 35

The target is frozen; at every step it computes its features (the hidden states entering its
LM head) and next-token distributions over a batch of training windows, and the head learns,
from the feature of position t - 1 and the embedding of token t, to predict the feature of
position t (smooth L1) and through the target's LM head the target's distribution (soft
cross-entropy). Drafting feeds predicted features back in, so each step also runs a second
pass whose input features are the first pass's predictions: the head learns to draft from its
own features, not only from the target's. The head's weights are saved in fp16 beside
``head_config.json``; the figures go to ``metrics.json`` (the model card quotes them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

from hetspec.models.cache_files import remove, temp_name
from hetspec.models.corpus import stdlib_sources
from hetspec.models.train_demo import chat_examples, cosine_lr, encode_documents, windows
from hetspec.workers.runtimes.torch_runtime.config import ModelConfig
from hetspec.workers.runtimes.torch_runtime.draft_head import (
    HEAD_CONFIG,
    DraftHead,
    HeadConfig,
    load_target_pieces,
)
from hetspec.workers.runtimes.torch_runtime.model import layer_rope_tables, rope_tables
from hetspec.workers.runtimes.torch_runtime.tokenizer import FolderTokenizer
from hetspec.workers.runtimes.torch_runtime.weights import load_model

MODELS = Path(__file__).parent
CPU = torch.device("cpu")
FEATURE_NOISE = 0.05  # uniform noise on the target's features: drafting reads imperfect ones
CLASSIFICATION_WEIGHT = 0.5  # the soft cross-entropy, against the feature regression's 1


class Teacher:
    """A frozen model folder run over whole windows: each position's features (the final
    norm's output) and next-token log-probabilities, as the torch runtime computes them."""

    def __init__(self, folder: Path) -> None:
        self.config = ModelConfig.from_folder(folder)
        self.model = load_model(folder, self.config, torch.float32, CPU)
        # the model's own rotary tables (one per kind: Gemma 3's windowed layers have theirs),
        # never a draft head's, which rotate as one Llama-style kind
        self._cos, self._sin = layer_rope_tables(self.config, self.config.max_context, CPU)

    def masks(self, n: int) -> list[torch.Tensor]:
        """Each layer's causal mask over a window of n tokens (a sliding window's keys reach
        no more than window - 1 positions back, as the runtime's)."""
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        offsets = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        by_window = {
            w: causal if w is None else causal & (offsets < w)
            for w in set(self.config.sliding_windows)
        }
        return [by_window[w] for w in self.config.sliding_windows]

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (batch, n) -> features (batch, n, hidden), log-probabilities (batch, n, vocab)."""
        model, c = self.model, self.config
        n = tokens.shape[1]
        if n > c.max_context:
            raise ValueError(f"{n} tokens exceed the model's {c.max_context}-token context")
        masks = self.masks(n)
        features, log_p = [], []
        for row in tokens:  # the runtime's model takes one sequence at a time
            shape = (c.num_layers, c.num_kv_heads, n, c.head_dim)
            keys, values = torch.zeros(shape), torch.zeros(shape)
            hidden = model(
                row,
                self._cos[:, :n],
                self._sin[:, :n],
                cache_keys=keys,
                cache_values=values,
                start=0,
                masks=masks,
            )
            features.append(model.model.norm(hidden))
            log_p.append(model.logits(hidden).log_softmax(-1))
        return torch.stack(features), torch.stack(log_p)


@dataclass(frozen=True)
class Batch:
    """Training windows as the head sees them: the target's features and next-token
    log-probabilities, and the tokens' embeddings (the target's)."""

    features: torch.Tensor
    log_p: torch.Tensor
    embeddings: torch.Tensor

    @classmethod
    def of(cls, tokens: torch.Tensor, teacher: Teacher, pieces) -> Batch:
        features, log_p = teacher(tokens)
        return cls(features, log_p, pieces.embed(tokens))


def head_losses(head, pieces, inputs: torch.Tensor, batch: Batch, rope):
    """One pass from ``inputs`` (the feature before each position): the predicted features,
    the regression, the soft cross-entropy and the head's log-probabilities."""
    predicted = pieces.feature(head.sequences(inputs, batch.embeddings, *rope))
    regression = F.smooth_l1_loss(predicted, batch.features)
    log_q = pieces.logits(predicted).log_softmax(-1)
    cross_entropy = -(batch.log_p.exp() * log_q).sum(-1).mean()
    return predicted, regression, cross_entropy, log_q


def shifted(features: torch.Tensor) -> torch.Tensor:
    """The feature before each position (zeros before the first)."""
    return F.pad(features[:, :-1], (0, 0, 1, 0))


@torch.no_grad()
def held_out(head, pieces, teacher, stream, *, length: int, rope) -> dict:
    """Greedy agreement with the target and sum(min(p, q)) (speculative sampling's acceptance
    at temperature 1), with the target's features (step 1) and with the head's own (step 2)."""
    head.eval()
    rng = np.random.default_rng(1234)
    totals = np.zeros(4)
    count = 0
    for _ in range(8):
        tokens = windows(stream, 8, length, rng)[:, :length]
        batch = Batch.of(tokens, teacher, pieces)
        inputs = shifted(batch.features)
        for step in range(2):
            predicted, _, _, log_q = head_losses(head, pieces, inputs, batch, rope)
            totals[2 * step] += (log_q.argmax(-1) == batch.log_p.argmax(-1)).sum().item()
            totals[2 * step + 1] += torch.minimum(batch.log_p.exp(), log_q.exp()).sum().item()
            inputs = shifted(predicted)
        count += tokens.numel()
    head.train()
    agree1, accept1, agree2, accept2 = (totals / count).round(4).tolist()
    return {
        "held_out_tokens": count,
        "step1_greedy_agreement": agree1,
        "step1_sampling_acceptance_t1": accept1,
        "step2_greedy_agreement": agree2,
        "step2_sampling_acceptance_t1": accept2,
    }


def train(head, pieces, teacher, stream, *, args, rope) -> tuple[int, list[tuple]]:
    """Train until the wall-clock budget (the step count is fixed after timing the first
    steps); returns the steps and each step's (loss, step-1 and step-2 cross-entropy)."""
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    rng = np.random.default_rng(args.seed)
    budget_s, calibrate, warmup = args.minutes * 60, 5, 30
    total, step, losses, started = None, 0, [], time.perf_counter()
    while total is None or step < total:
        lr = cosine_lr(step, total or 10**9, args.lr, warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens = windows(stream, args.batch, args.seq_len, rng)[:, : args.seq_len]
        batch = Batch.of(tokens, teacher, pieces)
        inputs = shifted(batch.features)
        inputs = inputs + torch.empty_like(inputs).uniform_(-FEATURE_NOISE, FEATURE_NOISE)
        predicted, reg1, ce1, _ = head_losses(head, pieces, inputs, batch, rope)
        _, reg2, ce2, _ = head_losses(head, pieces, shifted(predicted.detach()), batch, rope)
        loss = reg1 + reg2 + CLASSIFICATION_WEIGHT * (ce1 + ce2)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        losses.append((loss.item(), ce1.item(), ce2.item()))
        step += 1
        elapsed = time.perf_counter() - started
        if step == calibrate:
            total = max(calibrate + warmup, int(budget_s / (elapsed / step)))
            print(f"{elapsed / step:.2f} s/step: {total} steps in the budget", flush=True)
        if step % 25 == 0 or step == total:
            recent = np.mean(losses[-25:], axis=0)
            print(
                f"step {step}/{total} loss {recent[0]:.3f} ce1 {recent[1]:.3f} "
                f"ce2 {recent[2]:.3f} lr {lr:.2e} {elapsed / 60:.1f} min",
                flush=True,
            )
    return step, losses


def save_head(head: DraftHead, config: HeadConfig, out: Path) -> None:
    """The head's fp16 weights and config as the folder ``out``, which appears whole or not
    at all (built in a hidden sibling and renamed over any earlier head): an interrupted run
    never leaves a head that loads but is half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_name(out)
    temp.mkdir()
    try:
        state = {n: p.detach().to(torch.float16).contiguous() for n, p in head.named_parameters()}
        save_file(state, str(temp / "model.safetensors"))
        config.save(temp)
        # safetensors creates its file owner-only; give it the umask's mode like the config
        (temp / "model.safetensors").chmod((temp / HEAD_CONFIG).stat().st_mode & 0o777)
        if out.exists():
            remove(out)
        temp.rename(out)
    finally:
        remove(temp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.models.train_head")
    parser.add_argument("--target", type=Path, default=MODELS / "target")
    parser.add_argument("--out", type=Path, default=MODELS / "head")
    parser.add_argument("--minutes", type=float, default=35)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--fusion", choices=("dgf", "concat"), default="dgf")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--metrics",
        type=Path,
        default=None,
        help="where the figures go (default: OUT/../metrics.json, as OUT's name)",
    )
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    teacher = Teacher(args.target)
    target = teacher.config
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    train_files, held_out_files = stdlib_sources()
    train_docs = [text for _, text in train_files]
    train_docs += [ex for _, text in train_files for ex in chat_examples(text)]
    train_stream = encode_documents(tokenizer, train_docs)
    held_out_stream = encode_documents(tokenizer, [text for _, text in held_out_files])
    config = HeadConfig(
        feature_size=target.hidden_size,
        width=target.hidden_size,
        vocab_size=target.vocab_size,
        blocks=args.blocks,
        fusion=args.fusion,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        intermediate_size=target.intermediate_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope.theta,
        max_context=target.max_context,
        vocab_fingerprint=FolderTokenizer(args.target, target.vocab_size).vocab_info().fingerprint,
    )
    head = DraftHead(config)
    pieces = load_target_pieces(target, args.target, torch.float32, torch.device("cpu"))
    cos, sin = rope_tables(config.block_config(), args.seq_len, torch.device("cpu"))
    parameters = sum(p.numel() for p in head.parameters())
    print(
        f"head: {config.blocks} blocks, {config.fusion}, {parameters:,} parameters; "
        f"{len(train_stream):,} training tokens",
        flush=True,
    )

    train_start = time.perf_counter()
    step, losses = train(head, pieces, teacher, train_stream, args=args, rope=(cos, sin))
    train_minutes = round((time.perf_counter() - train_start) / 60, 1)
    metrics = held_out(head, pieces, teacher, held_out_stream, length=args.seq_len, rope=(cos, sin))
    print(f"held out: {metrics}", flush=True)
    save_head(head, config, args.out)
    report = {
        "shape": {"blocks": config.blocks, "fusion": config.fusion, "width": config.width},
        "parameters": parameters,
        "training": {
            "steps": step,
            "tokens_seen": step * args.batch * args.seq_len,
            "minutes": train_minutes,
            "final_loss": round(float(np.mean([loss[0] for loss in losses[-25:]])), 4),
            "batch": args.batch,
            "sequence_length": args.seq_len,
            "peak_lr": args.lr,
            "feature_noise": FEATURE_NOISE,
            "classification_weight": CLASSIFICATION_WEIGHT,
            "threads": args.threads,
            "torch": str(torch.__version__),
        },
        "held_out": metrics,
        "file_bytes": (args.out / "model.safetensors").stat().st_size,
        "total_minutes": round((time.perf_counter() - started) / 60, 1),
    }
    metrics_path = args.metrics or args.out.parent / "metrics.json"
    existing = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    existing[args.out.name if args.metrics is None else "head"] = report
    metrics_path.write_text(json.dumps(existing, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if math.isfinite(report["training"]["final_loss"]) else 1


if __name__ == "__main__":
    sys.exit(main())

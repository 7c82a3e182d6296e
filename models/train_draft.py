"""Train a draft for SmolLM2 that is not distilled from it, and export it.

    python -m hetspec.models.train_draft --minutes 40 [--out DIR] [--cache-dir DIR]

A small Llama with SmolLM2's tokenizer (the real model's, from ``ensure_smollm2``), trained
from scratch with next-token loss on ``draft_corpus`` (manual pages, package documentation,
the standard library: what this machine ships), never on the target's outputs. So its
agreement with the target is what an independent small model reaches, not what a distilled
one does; ``metrics.json`` reports it per position of held-out text, with the perplexities.

Training on two CPU cores is bounded by the output layer (49152 tokens): the loss is taken
over the ``--train-vocab`` tokens most frequent in the corpus (others are masked out of the
loss), so a step costs a fraction of the full softmax; the exported model keeps the whole
vocabulary, its rarely seen rows at their small initial values.

Writes ``DIR/`` (default ``<cache>/smollm2-draft``) atomically: config.json,
model.safetensors (f16), SmolLM2's tokenizer files, ``draft-q8_0.gguf`` and metrics.json. An
interrupted run leaves nothing that looks complete. Needs torch and transformers.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from hetspec.models.cache_files import default_cache_dir, remove, temp_name
from hetspec.models.draft_corpus import draft_corpus
from hetspec.models.gguf_export import export_gguf
from hetspec.models.smollm2 import RealModelError, ensure_smollm2
from hetspec.models.train_demo import cosine_lr, windows

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def encode(tokenizer: Tokenizer, documents: list[str], eos: int) -> np.ndarray:
    """One stream, each document ended with EOS (``<|endoftext|>``) as pretraining does."""
    encoded = tokenizer.encode_batch(documents, add_special_tokens=False)
    return np.concatenate([np.asarray([*e.ids, eos], dtype=np.int64) for e in encoded])


def draft_config(target: dict) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=target["vocab_size"],
        max_position_embeddings=target["max_position_embeddings"],
        rms_norm_eps=1e-5,
        rope_theta=target["rope_theta"],
        tie_word_embeddings=True,
        bos_token_id=target["bos_token_id"],
        eos_token_id=target["eos_token_id"],
        **SHAPE,
    )


def train(
    model: LlamaForCausalLM,
    stream: np.ndarray,
    kept: torch.Tensor,
    minutes: float,
    *,
    batch: int,
    length: int,
    peak_lr: float,
    seed: int,
) -> dict:
    """Next-token loss over the ``kept`` tokens until the wall-clock budget."""
    remap = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    remap[kept] = torch.arange(len(kept))
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    budget_s, calibrate, warmup = minutes * 60, 5, 20
    total, step, start, losses = None, 0, time.perf_counter(), []
    model.train()
    while total is None or step < total:
        lr = cosine_lr(step, total or 10**9, peak_lr, warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens = windows(stream, batch, length, rng)
        hidden = model.model(tokens[:, :-1]).last_hidden_state
        logits = hidden @ model.lm_head.weight[kept].T
        loss = F.cross_entropy(logits.flatten(0, 1), remap[tokens[:, 1:]].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        elapsed = time.perf_counter() - start
        if step == calibrate:
            total = max(calibrate + warmup, int(budget_s / (elapsed / step)))
            print(f"train_draft: {elapsed / step:.2f} s a step, {total} steps", flush=True)
        if step % 20 == 0 or step == total:
            print(
                f"train_draft: step {step}/{total} loss {np.mean(losses[-20:]):.3f} "
                f"lr {lr:.1e} {step * batch * length / elapsed:,.0f} tokens/s "
                f"{elapsed / 60:.1f} min",
                flush=True,
            )
    return {
        "steps": step,
        "tokens_seen": step * batch * length,
        "batch": batch,
        "sequence_length": length,
        "peak_lr": peak_lr,
        "minutes": round((time.perf_counter() - start) / 60, 1),
        "final_train_loss": round(float(np.mean(losses[-20:])), 4),
    }


@torch.no_grad()
def agreement(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    stream: np.ndarray,
    length: int = 256,
    windows_n: int = 16,
) -> dict:
    """On held-out text: how often the draft's argmax is the target's, overall and by
    position in the window, and both perplexities."""
    target.eval()
    draft.eval()
    rng = np.random.default_rng(1234)
    agree = torch.zeros(length)
    nll_t = nll_d = 0.0
    for _ in range(windows_n):
        tokens = windows(stream, 1, length, rng)
        inputs, labels = tokens[:, :-1], tokens[:, 1:].flatten()
        t_logits = target(inputs).logits.float()[0]
        d_logits = draft(inputs).logits.float()[0]
        agree += (t_logits.argmax(-1) == d_logits.argmax(-1)).float()
        nll_t += F.cross_entropy(t_logits, labels, reduction="sum").item()
        nll_d += F.cross_entropy(d_logits, labels, reduction="sum").item()
    count = windows_n * length
    by_quarter = agree.reshape(4, -1).sum(1) / (windows_n * length / 4)
    return {
        "held_out_tokens": count,
        "greedy_agreement": round(agree.sum().item() / count, 4),
        "greedy_agreement_by_quarter_of_window": [round(x, 4) for x in by_quarter.tolist()],
        "target_perplexity": round(math.exp(nll_t / count), 2),
        "draft_perplexity": round(math.exp(nll_d / count), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.models.train_draft", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--minutes", type=float, default=40)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--train-vocab", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        real = ensure_smollm2(args.cache_dir)
    except RealModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    out = args.out or (args.cache_dir or default_cache_dir()) / "smollm2-draft"
    torch.manual_seed(args.seed)
    tokenizer = Tokenizer.from_file(str(real.folder / "tokenizer.json"))
    target_config = json.loads((real.folder / "config.json").read_text())
    eos = target_config["eos_token_id"]
    started = time.perf_counter()
    train_docs, held_docs = draft_corpus()
    train_stream, held_stream = (
        encode(tokenizer, train_docs, eos),
        encode(tokenizer, held_docs, eos),
    )
    counts = np.bincount(train_stream, minlength=target_config["vocab_size"])
    kept = torch.from_numpy(np.sort(np.argsort(-counts)[: args.train_vocab]))
    coverage = counts[kept.numpy()].sum() / counts.sum()
    print(
        f"train_draft: {len(train_docs)} documents, {len(train_stream):,} tokens "
        f"({time.perf_counter() - started:.0f} s); held out {len(held_stream):,}; the "
        f"{args.train_vocab} most frequent tokens cover {coverage:.2%}",
        flush=True,
    )
    model = LlamaForCausalLM(draft_config(target_config))
    run = train(
        model,
        train_stream,
        kept,
        args.minutes,
        batch=args.batch,
        length=args.seq_len,
        peak_lr=3e-3,
        seed=args.seed,
    )
    print("train_draft: measuring agreement with the target on held-out text", flush=True)
    target = LlamaForCausalLM.from_pretrained(real.folder, dtype=torch.float32)
    metrics = agreement(target, model, held_stream)
    print(f"train_draft: {metrics}", flush=True)
    temp = temp_name(out)
    temp.mkdir(parents=True)
    try:
        model.config._name_or_path = "hetspec-smollm2-draft"
        model.to(torch.float16).save_pretrained(temp, safe_serialization=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(real.folder / name, temp / name)
        export_gguf(temp, temp / "draft-q8_0.gguf", "q8_0")
        report = {
            "target": str(real.gguf),
            "shape": SHAPE,
            "train_vocab": args.train_vocab,
            "train_vocab_coverage": round(float(coverage), 4),
            "corpus_tokens": {"train": len(train_stream), "held_out": len(held_stream)},
            "training": run,
            "held_out": metrics,
            "torch": str(torch.__version__),
        }
        (temp / "metrics.json").write_text(json.dumps(report, indent=2) + "\n")
        if out.exists():
            remove(out)
        temp.rename(out)
    finally:
        remove(temp)
    print(f"train_draft: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

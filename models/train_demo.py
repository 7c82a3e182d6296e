"""Train, distil and export hetspec's bundled demo models (a target and its draft).

    python -m hetspec.models.train_demo --out models --target-minutes 35 --draft-minutes 12

Data: the source of the CPython standard library this Python runs on (PSF licence; tests left
out), split by file into training and held-out parts, plus chat-formatted examples built from
its documented functions so the chat template leads somewhere. A byte-level BPE tokenizer is
trained on it; the target (a small Llama) is trained for a wall-clock budget; the draft is
distilled from the target's output distributions, so it agrees with the target as often as its
size allows. Both are written as Hugging Face folders (fp16 safetensors) and as GGUF (F16 and
Q8_0), with ``metrics.json`` holding the figures the model card quotes.

Needs torch, transformers and tokenizers (``make setup`` installs them).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import sysconfig
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from hetspec.models.corpus import stdlib_sources
from hetspec.models.gguf_export import export_gguf

BOS = "<|endoftext|>"
SPECIAL_TOKENS = [BOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool

    def config(self, vocab_size: int, bos_id: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden,
            intermediate_size=self.ffn,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            tie_word_embeddings=self.tied,
            bos_token_id=bos_id,
            eos_token_id=bos_id,
        )


TARGET = ModelShape(layers=4, hidden=256, heads=8, kv_heads=4, ffn=704, tied=False)
DRAFT = ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, ffn=352, tied=True)


# ---------------------------------------------------------------- data


def chat_examples(text: str) -> list[str]:
    """'Write a function that <docstring line>' -> the function, in the chat format.

    Every second documented function, so chat stays a small share (~12%) of the data.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    functions = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(node)
    ]
    examples = []
    for node in functions[::2]:
        source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        if len(source) > 1500:
            continue
        request = ast.get_docstring(node).strip().splitlines()[0]
        examples.append(
            f"<|im_start|>user\nWrite a Python function `{node.name}`: {request}<|im_end|>\n"
            f"<|im_start|>assistant\n```python\n{source}\n```<|im_end|>\n"
        )
    return examples


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def encode_documents(tokenizer: Tokenizer, documents: list[str]) -> np.ndarray:
    """One stream: each document starts with BOS, as a prompt does at inference."""
    encoded = tokenizer.encode_batch(documents)  # the template adds BOS
    return np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encoded])


def windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - length - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s : s + length + 1] for s in starts]))


# ---------------------------------------------------------------- training


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_for(
    name: str,
    model: LlamaForCausalLM,
    loss_of_batch,
    minutes: float,
    stream: np.ndarray,
    *,
    batch: int,
    length: int,
    peak_lr: float,
    seed: int,
) -> dict:
    """Train until the wall-clock budget; the step count is fixed after timing the first steps."""
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    budget_s, calibrate, warmup = minutes * 60, 8, 30
    total_steps, step, start = None, 0, time.perf_counter()
    losses: list[float] = []
    model.train()
    while total_steps is None or step < total_steps:
        lr = cosine_lr(step, total_steps or 10**9, peak_lr, warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = loss_of_batch(windows(stream, batch, length, rng))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        elapsed = time.perf_counter() - start
        if step == calibrate:
            total_steps = max(calibrate + warmup, int(budget_s / (elapsed / step)))
            print(f"[{name}] {elapsed / step:.2f} s/step: {total_steps} steps in the budget")
        if step % 25 == 0 or step == total_steps:
            recent = sum(losses[-25:]) / len(losses[-25:])
            tokens_per_s = step * batch * length / elapsed
            print(
                f"[{name}] step {step}/{total_steps} loss {recent:.3f} lr {lr:.2e} "
                f"{tokens_per_s:,.0f} tok/s {elapsed / 60:.1f} min",
                flush=True,
            )
    return {
        "steps": step,
        "tokens_seen": step * batch * length,
        "minutes": round((time.perf_counter() - start) / 60, 1),
        "final_train_loss": round(sum(losses[-25:]) / len(losses[-25:]), 4),
        "batch": batch,
        "sequence_length": length,
        "peak_lr": peak_lr,
    }


@torch.no_grad()
def held_out_metrics(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, stream: np.ndarray, length: int
) -> dict:
    """Perplexities, greedy agreement and the expected acceptance of speculative sampling."""
    target.eval()
    draft.eval()
    rng = np.random.default_rng(1234)
    nll_t = nll_d = agree = accept = count = 0.0
    for _ in range(16):
        batch = windows(stream, 8, length, rng)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        t_logits = target(inputs).logits.float()
        d_logits = draft(inputs).logits.float()
        nll_t += F.cross_entropy(t_logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
        nll_d += F.cross_entropy(d_logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
        agree += (t_logits.argmax(-1) == d_logits.argmax(-1)).sum().item()
        p, q = t_logits.softmax(-1), d_logits.softmax(-1)
        accept += torch.minimum(p, q).sum(-1).sum().item()  # P(accept) at temperature 1
        count += labels.numel()
    return {
        "held_out_tokens": int(count),
        "target_perplexity": round(math.exp(nll_t / count), 3),
        "draft_perplexity": round(math.exp(nll_d / count), 3),
        "greedy_agreement": round(agree / count, 4),
        "sampling_acceptance_t1": round(accept / count, 4),
    }


# ---------------------------------------------------------------- export


def write_tokenizer_files(tokenizer: Tokenizer, out_dir: Path, max_length: int) -> None:
    """tokenizer.json plus the tokenizer_config.json (BOS/EOS, chat template) beside it."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": BOS,
        "pad_token": BOS,
        "add_bos_token": True,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def save_model(model: LlamaForCausalLM, tokenizer: Tokenizer, out_dir: Path, name: str) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config._name_or_path = f"hetspec-demo-{name}"
    model.to(torch.float16).save_pretrained(out_dir, safe_serialization=True)
    model.to(torch.float32)
    write_tokenizer_files(tokenizer, out_dir, model.config.max_position_embeddings)
    sizes = {}
    for gguf_type in ("f16", "q8_0"):
        path = export_gguf(out_dir, out_dir / f"{name}-{gguf_type}.gguf", gguf_type)
        sizes[path.name] = path.stat().st_size
    sizes["model.safetensors"] = (out_dir / "model.safetensors").stat().st_size
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.models.train_demo")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--target-minutes", type=float, default=35)
    parser.add_argument("--draft-minutes", type=float, default=12)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=len(__import__("os").sched_getaffinity(0)))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    train_files, held_out_files = stdlib_sources()
    train_docs = [text for _, text in train_files]
    train_docs += [ex for _, text in train_files for ex in chat_examples(text)]
    held_out_docs = [text for _, text in held_out_files]
    tokenizer = train_tokenizer(train_docs, args.vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    train_stream = encode_documents(tokenizer, train_docs)
    held_out_stream = encode_documents(tokenizer, held_out_docs)
    print(
        f"data: {len(train_files)} train files + {len(train_docs) - len(train_files)} chat "
        f"examples = {len(train_stream):,} tokens; held out {len(held_out_files)} files = "
        f"{len(held_out_stream):,} tokens; vocab {vocab_size}",
        flush=True,
    )
    bos_id = tokenizer.token_to_id(BOS)

    target = LlamaForCausalLM(TARGET.config(vocab_size, bos_id))

    def target_loss(batch: torch.Tensor) -> torch.Tensor:
        logits = target(batch[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    target_run = train_for(
        "target",
        target,
        target_loss,
        args.target_minutes,
        train_stream,
        batch=8,
        length=args.seq_len,
        peak_lr=2e-3,
        seed=args.seed,
    )

    draft = LlamaForCausalLM(DRAFT.config(vocab_size, bos_id))
    target.eval()

    def distillation_loss(batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad():
            teacher = target(inputs).logits.float().log_softmax(-1)
        student = draft(inputs).logits.float().log_softmax(-1)
        # Forward KL(target || draft): the draft learns to put mass where the target does.
        return F.kl_div(
            student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean"
        )

    draft_run = train_for(
        "draft",
        draft,
        distillation_loss,
        args.draft_minutes,
        train_stream,
        batch=8,
        length=args.seq_len,
        peak_lr=3e-3,
        seed=args.seed + 1,
    )

    metrics = held_out_metrics(target, draft, held_out_stream, args.seq_len)
    print(f"held out: {metrics}", flush=True)
    files = {
        "target": save_model(target, tokenizer, args.out / "target", "target"),
        "draft": save_model(draft, tokenizer, args.out / "draft", "draft"),
    }
    report = {
        "python": sys.version.split()[0],
        "stdlib": sysconfig.get_paths()["stdlib"],
        "torch": str(torch.__version__),
        "threads": args.threads,
        "seed": args.seed,
        "data": {
            "train_files": len(train_files),
            "chat_examples": len(train_docs) - len(train_files),
            "train_tokens": len(train_stream),
            "held_out_files": len(held_out_files),
            "held_out_tokens": len(held_out_stream),
            "vocab_size": vocab_size,
        },
        "target": {
            "shape": asdict(TARGET),
            "parameters": sum(p.numel() for p in target.parameters()),
            "training": target_run,
        },
        "draft": {
            "shape": asdict(DRAFT),
            "parameters": sum(p.numel() for p in draft.parameters()),
            "distillation": draft_run,
        },
        "held_out": metrics,
        "file_bytes": files,
        "total_minutes": round((time.perf_counter() - started) / 60, 1),
    }
    (args.out / "metrics.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

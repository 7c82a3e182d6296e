"""What int8 weights (``gpu_worker.weights = "int8"``) cost a model in quality, offline.

    python -m hetspec.models.int8_quality [--model DIR] [--draft DIR] [--files 8]
                                          [--tokens 256]

Runs the model folder in float32 on the CPU over held-out text (the first ``--tokens`` tokens
of ``--files`` standard-library files the bundled models never saw), once as it is and once
with int8 weights as the worker makes them (``int8_weights.use_int8_weights``: every linear
layer and the output head, a tied embedding kept for its lookups), and says at how many
positions the two choose the same next token, their mean KL divergence, and each one's
perplexity on the text.
With ``--draft``, also how often that draft model's first choice is each version's: what a
drafted token's acceptance becomes. Needs no GPU and no Triton: windows of more than 16 rows
take the layers' torch path (the weight widened, in float32 here), whose sums differ from the
kernel's by float32 rounding alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from hetspec.models.corpus import stdlib_sources
from hetspec.models.train_head import Teacher
from hetspec.workers.runtimes.torch_runtime.int8_weights import use_int8_weights
from hetspec.workers.runtimes.torch_runtime.skinny_matmul import MAX_ROWS

MODELS = Path(__file__).parent


def rounded_as_int8(teacher: Teacher) -> Teacher:
    """``teacher`` with int8 weights, in place, as the worker's ``use_int8_weights`` makes
    them: a window's rows are more than the Triton kernel takes, so its layers widen their
    weights for torch's matmul (float32 here), with no GPU and no Triton."""
    use_int8_weights(teacher.model)
    return teacher


def texts(files: int, tokens: int, tokenizer: Tokenizer) -> list[torch.Tensor]:
    """The first ``tokens`` tokens of the first ``files`` held-out sources that have them."""
    windows = []
    for _, text in stdlib_sources()[1]:
        ids = tokenizer.encode(text).ids
        if len(ids) > tokens:
            windows.append(torch.tensor(ids[:tokens]))
        if len(windows) == files:
            break
    return windows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.models.int8_quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, default=MODELS / "target", help="model folder")
    parser.add_argument("--draft", type=Path, default=None, help="a draft model folder")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args(argv)
    if args.tokens <= MAX_ROWS:  # a window of so few rows would take the Triton kernel
        parser.error(f"--tokens must be more than {MAX_ROWS}, not {args.tokens}")
    try:
        tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
        full, int8 = Teacher(args.model), rounded_as_int8(Teacher(args.model))
        draft = Teacher(args.draft) if args.draft else None
    except Exception as error:  # a folder that does not load: say which and why
        print(f"error: {error}", file=sys.stderr)
        return 1
    windows = texts(args.files, args.tokens, tokenizer)
    if not windows:
        print(f"error: no held-out file has more than {args.tokens} tokens", file=sys.stderr)
        return 1
    same = positions = 0
    kl = nll_full = nll_int8 = 0.0
    draft_full = draft_int8 = 0
    for window in windows:
        log_p = full(window.view(1, -1))[1][0, :-1]
        log_q = int8(window.view(1, -1))[1][0, :-1]
        following = window[1:]
        choice_full, choice_int8 = log_p.argmax(-1), log_q.argmax(-1)
        same += int((choice_full == choice_int8).sum())
        positions += len(following)
        kl += float((log_p.exp() * (log_p - log_q)).sum())
        nll_full -= float(log_p.gather(1, following[:, None]).sum())
        nll_int8 -= float(log_q.gather(1, following[:, None]).sum())
        if draft is not None:
            proposal = draft(window.view(1, -1))[1][0, :-1].argmax(-1)
            draft_full += int((proposal == choice_full).sum())
            draft_int8 += int((proposal == choice_int8).sum())
    print(
        f"{args.model}: {len(windows)} held-out files x {args.tokens} tokens, "
        f"{positions} next-token choices"
    )
    print(f"  int8's first choice is the full model's at {same / positions:.2%} of positions")
    print(f"  KL(full || int8): {kl / positions:.5f} nats a position")
    print(
        f"  perplexity on the text: full {torch.tensor(nll_full / positions).exp():.3f}, "
        f"int8 {torch.tensor(nll_int8 / positions).exp():.3f}"
    )
    if draft is not None:
        print(
            f"  the draft's first choice is the target's: full {draft_full / positions:.2%}, "
            f"int8 {draft_int8 / positions:.2%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

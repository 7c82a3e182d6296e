"""The systems hetspec is compared with, on the same bundled models, counted as it counts.

    python -m hetspec.workers.peers --prompts PROMPTS.json [--max-tokens 128] [--repeats 3]

``hetspec bench`` runs this as a process of its own (the client never imports torch or
llama.cpp) and reads one JSON object per line: system, prompt, repeat, tokens, decode_ms,
ttft_ms. Greedy, exactly ``--max-tokens`` tokens (EOS ignored), both cores for each system:

- ``transformers assisted``: Hugging Face transformers' assisted generation,
  ``target.generate(assistant_model=draft)``, the peer most users would reach for;
- ``llama.cpp speculative``: both GGUF models in llama.cpp in one process, draft gamma
  tokens then verify them in one batch, as llama.cpp's own speculative example does (through
  this package's llama.cpp runtime: the same library calls, none of hetspec's processes).

Decode time is the time after the first token (which comes with the prefill in every system)
and covers the other max_tokens - 1 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from hetspec.speculative.verify import verify_greedy

MODELS = Path(__file__).resolve().parents[1] / "models"


def transformers_assisted(prompts, max_tokens: int, repeats: int, threads: int):
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "target")
    target = AutoModelForCausalLM.from_pretrained(MODELS / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(MODELS / "draft", dtype=torch.float32).eval()

    def run(ids, count: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(ids, assistant_model=draft, do_sample=False,
                                  max_new_tokens=count, min_new_tokens=count)  # fmt: skip
        assert out.shape[1] - ids.shape[1] == count
        return (time.perf_counter() - start) * 1000

    run(tokenizer(prompts[0], return_tensors="pt").input_ids, 8)  # warm-up
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            first = run(ids, 1)
            total = run(ids, max_tokens)
            yield "transformers assisted", index, repeat, first, total - first


def llama_cpp_speculative(prompts, max_tokens: int, repeats: int, threads: int, gamma: int = 4):
    from hetspec.protocol.sampling import SamplingParams  # noqa: PLC0415
    from hetspec.workers.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415

    target = LlamaCppRuntime(MODELS / "target" / "target-q8_0.gguf", n_ctx=2048, threads=threads)
    draft = LlamaCppRuntime(MODELS / "draft" / "draft-q8_0.gguf", n_ctx=2048, threads=threads)
    greedy, rng = SamplingParams(), np.random.default_rng(0)

    def run(prompt: str) -> tuple[float, float]:
        start = time.perf_counter()
        tokens = target.tokenize(prompt)
        target.prefill(tokens)
        draft.prefill(tokens)
        bonus = int(np.argmax(target.last_logits()))
        first = time.perf_counter()
        emitted, behind = 1, [bonus]
        while emitted < max_tokens:
            draft.append(behind)
            drafted = draft.draft(gamma, greedy, rng).tokens[0].tolist()
            chain = list(range(-1, gamma - 1))
            logits = target.evaluate_tree([bonus, *drafted], [-1, *(p + 1 for p in chain)])
            verdict = verify_greedy(drafted, chain, logits)
            target.commit([0, *(node + 1 for node in verdict.path)])
            behind = [drafted[node] for node in verdict.path] + [verdict.bonus]
            bonus = verdict.bonus
            emitted += len(behind)
        end = time.perf_counter()
        return (first - start) * 1000, (end - first) * 1000 * (max_tokens - 1) / (emitted - 1)

    run(prompts[0])  # warm-up
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            ttft, decode = run(prompt)
            yield f"llama.cpp speculative gamma={gamma}", index, repeat, ttft, decode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.workers.peers")
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args(argv)
    prompts = json.loads(args.prompts.read_text())
    for peer in (llama_cpp_speculative, transformers_assisted):
        for system, index, repeat, ttft, decode in peer(prompts, args.max_tokens, args.repeats,
                                                        args.threads):  # fmt: skip
            record = {"system": system, "prompt": index, "repeat": repeat,
                      "tokens": args.max_tokens, "ttft_ms": ttft, "decode_ms": decode}  # fmt: skip
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

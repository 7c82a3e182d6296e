"""The systems hetspec is compared with, on the same bundled models, counted as it counts.

    python -m hetspec.workers.peers [--threads N]

``hetspec bench`` runs this as a process of its own (the client never imports torch or
llama.cpp) and interleaves its requests with hetspec's, so that a box whose speed drifts (a
shared VM's did by up to 2x within an hour) slows every system alike. It loads both peers,
writes ``{"systems": [...]}`` as its first line, then answers one JSON request per line
(``{"system", "prompt", "max_tokens"}``) with ``{"ttft_ms", "decode_ms", "tokens"}`` (or
``{"error"}``). Greedy, exactly ``max_tokens`` tokens (EOS ignored), all of the process's
cores for each system:

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
from typing import TextIO

import numpy as np

from hetspec.speculative.verify import verify_greedy

MODELS = Path(__file__).resolve().parents[1] / "models"


class TransformersAssisted:
    name = "transformers assisted"

    def __init__(self, threads: int) -> None:
        import torch  # noqa: PLC0415
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        torch.set_num_threads(threads)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(MODELS / "target")
        load = AutoModelForCausalLM.from_pretrained
        self.target = load(MODELS / "target", dtype=torch.float32).eval()
        self.draft = load(MODELS / "draft", dtype=torch.float32).eval()

    def _generate(self, ids, count: int) -> float:
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.target.generate(ids, assistant_model=self.draft, do_sample=False,
                                       max_new_tokens=count, min_new_tokens=count)  # fmt: skip
        assert out.shape[1] - ids.shape[1] == count
        return (time.perf_counter() - start) * 1000

    def run(self, prompt: str, max_tokens: int) -> tuple[float, float]:
        """(TTFT, decode) in ms: transformers cannot report the first token's time, so the
        prompt runs twice, for one token and for all of them."""
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        first = self._generate(ids, 1)
        return first, self._generate(ids, max_tokens) - first


class LlamaCppSpeculative:
    def __init__(self, threads: int, gamma: int = 4) -> None:
        from hetspec.protocol.sampling import SamplingParams  # noqa: PLC0415
        from hetspec.workers.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415

        self.name = f"llama.cpp speculative gamma={gamma}"
        self.gamma = gamma
        self.target = LlamaCppRuntime(MODELS / "target" / "target-q8_0.gguf", n_ctx=2048,
                                      threads=threads)  # fmt: skip
        self.draft = LlamaCppRuntime(MODELS / "draft" / "draft-q8_0.gguf", n_ctx=2048,
                                     threads=threads)  # fmt: skip
        self.greedy, self.rng = SamplingParams(), np.random.default_rng(0)

    def run(self, prompt: str, max_tokens: int) -> tuple[float, float]:
        target, draft, gamma = self.target, self.draft, self.gamma
        start = time.perf_counter()
        tokens = target.tokenize(prompt)
        target.prefill(tokens)
        draft.prefill(tokens)
        bonus = int(np.argmax(target.last_logits()))
        first = time.perf_counter()
        emitted, behind = 1, [bonus]
        while emitted < max_tokens:
            draft.append(behind)
            drafted = draft.draft(gamma, self.greedy, self.rng).tokens[0].tolist()
            chain = list(range(-1, gamma - 1))
            logits = target.evaluate_tree([bonus, *drafted], [-1, *(p + 1 for p in chain)])
            verdict = verify_greedy(drafted, chain, logits)
            target.commit([0, *(node + 1 for node in verdict.path)])
            behind = [drafted[node] for node in verdict.path] + [verdict.bonus]
            bonus = verdict.bonus
            emitted += len(behind)
        end = time.perf_counter()
        return (first - start) * 1000, (end - first) * 1000 * (max_tokens - 1) / (emitted - 1)


def serve(threads: int, requests: TextIO, replies: TextIO) -> None:
    peers = {peer.name: peer for peer in (LlamaCppSpeculative(threads),
                                          TransformersAssisted(threads))}  # fmt: skip
    for peer in peers.values():
        peer.run("def main():\n", 8)  # warm-up

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    reply({"systems": list(peers)})
    for line in requests:
        try:
            request = json.loads(line)
            peer = peers[request["system"]]
            ttft, decode = peer.run(request["prompt"], request["max_tokens"])
        except (ValueError, KeyError, TypeError) as error:
            reply({"error": f"bad request {line.strip()[:200]!r}: {error!r}"})
            continue
        reply({"ttft_ms": ttft, "decode_ms": decode, "tokens": request["max_tokens"]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.workers.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args(argv)
    serve(args.threads, sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

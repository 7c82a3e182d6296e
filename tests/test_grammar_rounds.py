"""Structured output in the round loop, on in-process workers: every round kind keeps the
output the constrained target's own (greedy, keyed) and valid under the grammar; forced
tokens are emitted without a draft."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter

import numpy as np
import pytest
from fake_worker import VOCAB, TableModel
from laws import chi2_critical, chi_square
from test_engine import FIXED, PROMPT, workers

from hetspec.daemon.decode.engine import Decoder, LookupSource
from hetspec.daemon.decode.grammar_compiler import GrammarCompiler
from hetspec.daemon.decode.requests import GenerateRequest, GenerationResult
from hetspec.daemon.decode.round_stats import SpeculativeStats
from hetspec.protocol.arena import Arena
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.constrain.constraint import Constraint, ConstraintBroken
from hetspec.speculative.constrain.grammars import Grammar, GrammarError, grammar_text
from hetspec.speculative.constrain.token_table import grammar_tokenizer
from hetspec.speculative.control.budget import BudgetController, ControllerConfig
from hetspec.speculative.drafting.continuation_tree import ContinuationTree
from hetspec.speculative.verify.distributions import distribution

EOS = VOCAB - 1
# letters only (the table model's ids 0..25), a forced run after each "q", ending allowed
REGEX = r"([a-p]{1,3}quvw|[r-z]{2})+"


@pytest.fixture(scope="module")
def tokenizer():
    model = TableModel.pair()[0]
    return grammar_tokenizer([model.token_bytes(i) for i in range(VOCAB)], [], [EOS])


@pytest.fixture
def arena():
    arena = Arena.create(f"/dev/shm/hetspec-test-{uuid.uuid4().hex}", 2, 64 * 4 * 16 * VOCAB)
    yield arena
    arena.close()


def constraint(tokenizer, regex: str = REGEX) -> Constraint:
    return Constraint(tokenizer, grammar_text("regex", regex))


def constrained_greedy(model: TableModel, tokenizer, count: int) -> list[int]:
    """The target's own greedy output under the grammar, one masked argmax at a time."""
    grammar, sequence, out = constraint(tokenizer), model.tokenize(PROMPT), []
    for _ in range(count):
        prev = sequence[-2] if len(sequence) > 1 else 0
        row = model._logits(prev, sequence[-1], len(sequence) - 1)
        token = int(np.argmax(grammar.masked(row)))
        if token == EOS:
            break
        grammar.advance([token])
        sequence.append(token)
        out.append(token)
    return out


def decode(pair, controller, grammar, *, plan=None, lookup=None, max_tokens=60, **options):
    request = GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, **options)
    stats, result = SpeculativeStats(), GenerationResult()
    decoder = Decoder(
        request, pair, controller, stats, plan=plan, lookup=lookup, constraint=grammar
    )

    async def run() -> str:
        return "".join([piece async for piece in decoder.stream(result)])

    return result, stats, asyncio.run(run())


@pytest.mark.parametrize("noise", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("kind", sorted(FIXED))
def test_every_kind_of_round_gives_the_constrained_targets_greedy_output(
    arena, tokenizer, kind, noise
) -> None:
    pair, reference = workers(arena, noise=noise)
    grammar = constraint(tokenizer)
    result, stats, _ = decode(pair, BudgetController(), grammar, plan=FIXED[kind])
    assert result.tokens == constrained_greedy(reference, tokenizer, 60)
    assert result.tokens != reference.greedy(PROMPT, 60)[: len(result.tokens)]
    constraint(tokenizer).advance(result.tokens)  # a valid prefix, or ConstraintBroken
    assert stats.grammar_forced > 0  # "uvw" after each "q" is forced


@pytest.mark.parametrize("lookup", [None, LookupSource(ContinuationTree)])
def test_the_controllers_plans_and_model_free_drafts_keep_it(arena, tokenizer, lookup) -> None:
    pair, reference = workers(arena, noise=0.5)
    controller = BudgetController(ControllerConfig.of(max_width=63))
    for _ in range(2):
        result, _, _ = decode(pair, controller, constraint(tokenizer), lookup=lookup)
        assert result.tokens == constrained_greedy(reference, tokenizer, 60)


def test_a_seeded_request_gives_the_same_valid_text_in_every_kind_of_round(
    arena, tokenizer
) -> None:
    texts = set()
    for kind in sorted(FIXED):
        pair, _ = workers(arena, noise=1.0)
        grammar = constraint(tokenizer)
        result, _, text = decode(
            pair, BudgetController(), grammar, plan=FIXED[kind], temperature=0.9, seed=5
        )
        constraint(tokenizer).advance(result.tokens)
        texts.add(text)
    assert len(texts) == 1


@pytest.mark.parametrize("kind", ["plain", "alone"])
def test_a_grammar_that_ends_ends_the_request(arena, tokenizer, kind) -> None:
    pair, _ = workers(arena, noise=1.0)
    grammar = Constraint(tokenizer, grammar_text("regex", "(ab|cd)[e-z]{2}quvw"))
    result, stats, text = decode(pair, BudgetController(), grammar, plan=FIXED[kind])
    assert re.fullmatch("(ab|cd)[e-z]{2}quvw", text), text
    assert result.done_reason == "stop"
    assert stats.grammar_forced >= 1  # "uvw" after "q", where the drafter did not draft it


def masked_law(model: TableModel, tokenizer, params: SamplingParams) -> list[dict[int, float]]:
    """P(token i = x) for the first two tokens under the grammar, by enumeration."""
    base = model.tokenize(PROMPT)

    def law_after(prefix: list[int]) -> dict[int, float]:
        sequence = base + prefix
        row = model._logits(sequence[-2], sequence[-1], len(sequence) - 1)
        grammar = constraint(tokenizer)
        grammar.advance(prefix)
        probs = distribution(grammar.masked(row)[None, :], params)[0]
        return {int(t): float(probs[t]) for t in np.flatnonzero(probs > 0)}

    first = law_after([])
    second: dict[int, float] = {}
    for token, p in first.items():
        for following, q in law_after([token]).items():
            second[following] = second.get(following, 0.0) + p * q
    return [first, second]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "alone"])
def test_drawn_tokens_follow_the_masked_targets_law(arena, tokenizer, kind) -> None:
    """Unseeded sampling under a grammar: drafted tokens the grammar forbids are never kept,
    and what is emitted follows the masked, renormalized target (chi-square, two positions)."""
    params = SamplingParams(temperature=1.0)
    law = masked_law(TableModel.pair(0, 1.0)[0], tokenizer, params)
    trials, counts = 1200, [Counter(), Counter()]
    for _ in range(trials):
        pair, _ = workers(arena, noise=1.0)
        grammar = constraint(tokenizer)
        result, _, _ = decode(
            pair, BudgetController(), grammar, plan=FIXED[kind], max_tokens=2, temperature=1.0
        )
        for index, token in enumerate(result.tokens[:2]):
            counts[index][token] += 1
    for index in range(2):
        statistic, df = chi_square(counts[index], law[index], trials)
        assert statistic < chi2_critical(df, 0.001 / 2), (index, statistic, df)


def test_the_compiler_builds_one_table_per_verifier_and_names_bad_grammars(arena) -> None:
    pair, _ = workers(arena)
    ready, compiler = pair.verifier.ready, GrammarCompiler()
    first = asyncio.run(compiler.compile(Grammar("regex", "ab+"), ready))
    second = asyncio.run(compiler.compile(Grammar("regex", "cd"), ready))
    assert compiler._table[0] is ready
    first.advance([0, 1, 1])  # "abb"
    assert first.fresh().forced(4) == [0, 1]  # from the start: "ab" is forced
    with pytest.raises(ConstraintBroken):
        second.advance([0])
    with pytest.raises(GrammarError, match="regex"):
        asyncio.run(compiler.compile(Grammar("regex", "(a"), ready))
    with pytest.raises(GrammarError, match="within"):
        asyncio.run(GrammarCompiler(timeout_s=1e-6).compile(Grammar("regex", "x"), ready))

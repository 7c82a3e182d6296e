"""Model-free drafts in the round loop, on in-process workers: chosen by the controller against
its plans, lossless in greedy, keyed and drawn sampling, chains where the verifier needs them."""

from __future__ import annotations

import uuid
from collections import Counter

import numpy as np
import pytest
from fake_worker import VOCAB, InProcessWorker, TableModel
from laws import chi2_critical, chi_square, exact_marginals
from test_engine import PROMPT, decode, workers

from hetspec.daemon.decode.engine import LookupSource, WorkerPair
from hetspec.protocol import worker_messages as m
from hetspec.protocol.arena import Arena
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.control.budget import BudgetController, ControllerConfig
from hetspec.speculative.control.rounds import Plan
from hetspec.speculative.drafting.continuation_tree import ContinuationTree
from hetspec.speculative.drafting.model_free import TreeProposal


@pytest.fixture
def arena():
    arena = Arena.create(f"/dev/shm/hetspec-test-{uuid.uuid4().hex}", 2, 64 * 4 * 16 * VOCAB)
    yield arena
    arena.close()


class Rounds:
    """A round sink: each round's plan and report."""

    def __init__(self) -> None:
        self.rounds = []

    def __call__(self, plan, report, *, seconds, emitted) -> None:
        self.rounds.append((plan, report))

    @property
    def lookups(self) -> int:
        return sum(report.lookup is not None for _, report in self.rounds)


def controller() -> BudgetController:
    return BudgetController(ControllerConfig.of(max_width=63))


@pytest.mark.parametrize("children", [None, 1])
def test_model_free_drafts_keep_greedy_output_the_targets_own(arena, children) -> None:
    pair, reference = workers(arena, noise=1.0)
    rounds, lookup = Rounds(), LookupSource(ContinuationTree, children)
    result, _, _ = decode(pair, controller(), max_tokens=80, log=rounds, lookup=lookup)
    assert result.tokens == reference.greedy(PROMPT, 80)
    assert rounds.lookups >= 3
    trees = [c for c in pair.verifier.commands if isinstance(c, m.VerifyTree)]
    if children == 1:  # a verifier of chains gets chains: each node below the one before
        assert all(c.parents == list(range(-1, len(c.parents) - 1)) for c in trees)


def test_a_repeating_text_commits_several_tokens_a_lookup_round(arena) -> None:
    pair, reference = workers(arena, noise=3.0)  # a poor draft model: lookups pay more
    rounds = Rounds()
    request = {"max_tokens": 96, "log": rounds, "lookup": LookupSource(ContinuationTree)}
    result, _, _ = decode(pair, controller(), **request)
    assert result.tokens == reference.greedy(PROMPT, 96)
    accepted = [report.accepted for _, report in rounds.rounds if report.lookup is not None]
    assert np.mean(accepted) > 2


def test_a_seeded_request_gives_the_same_text_with_model_free_drafts(arena) -> None:
    texts = []
    for lookup in (None, LookupSource(ContinuationTree)):
        pair, _ = workers(arena, noise=1.0)
        rounds = Rounds()
        result, _, _ = decode(
            pair, controller(), max_tokens=80, temperature=0.8, seed=11, log=rounds, lookup=lookup
        )
        texts.append(result.tokens)
        assert (rounds.lookups > 0) == (lookup is not None)
    alone, _ = workers(arena, noise=1.0)
    result, _, _ = decode(
        alone, controller(), plan=Plan(0), max_tokens=80, temperature=0.8, seed=11
    )
    assert texts[0] == texts[1] == result.tokens


def test_a_requests_own_gamma_runs_its_plan_not_model_free_drafts(arena) -> None:
    pair, _ = workers(arena, noise=1.0)
    rounds = Rounds()
    decode(pair, controller(), plan=Plan(3), log=rounds, lookup=LookupSource(ContinuationTree))
    assert rounds.lookups == 0


class Insistent:
    """A model-free drafter that always proposes the same two-token chain, certain of it."""

    def __init__(self, tokens=(3, 5)) -> None:
        self.tokens = list(tokens)

    def __len__(self) -> int:
        return 0

    def extend(self, tokens) -> None:
        pass

    def propose(self, max_tokens: int) -> list[int]:
        return self.tokens[:max_tokens]

    def propose_tree(self, max_nodes: int, max_children=None) -> TreeProposal:
        count = min(max_nodes, len(self.tokens))
        return TreeProposal(self.tokens[:count], list(range(-1, count - 1)), [0.99] * count)


@pytest.mark.slow
def test_drawn_tokens_follow_the_targets_law_whatever_the_model_free_draft_proposes(arena):
    """One-hot proposals (certain of their token): each kept with the target's probability of
    it, the bonus drawn from what is left. The first three tokens' marginals over many
    unseeded requests fit the target's exact law (chi-square, Bonferroni over the three)."""
    params = SamplingParams(temperature=1.0, top_k=4)
    law = exact_marginals(TableModel.pair(0, 1.0)[0], PROMPT, params)
    trials, counts = 1500, [Counter(), Counter(), Counter()]
    ruler = controller()
    lookups = 0
    for _ in range(trials):
        pair, _ = workers(arena, noise=1.0)
        rounds = Rounds()
        result, _, _ = decode(
            pair,
            ruler,
            max_tokens=3,
            temperature=1.0,
            top_k=4,
            log=rounds,
            lookup=LookupSource(Insistent),
        )
        lookups += rounds.lookups
        for index, token in enumerate(result.tokens[:3]):
            counts[index][token] += 1
    assert lookups >= trials  # the draft was weighed in and verified, most requests
    for index in range(3):
        statistic, df = chi_square(counts[index], law[index], trials)
        assert statistic < chi2_critical(df, 0.001 / 3), (index, statistic, df)


def target_only(arena):
    target, _ = TableModel.pair(0, 1.0, -4.0)
    reference, _ = TableModel.pair(0, 1.0, -4.0)
    pair = WorkerPair(
        None, InProcessWorker("gpu", target, arena), arena, draft_slot=0, verify_slot=1
    )
    return pair, reference


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_target_without_a_draft_model_speculates_from_its_own_text(arena, temperature) -> None:
    """No draft model: rounds are the target alone and model-free drafts; greedy output is
    the target's own and seeded text the target alone's."""
    texts = []
    for lookup in (None, LookupSource(ContinuationTree)):
        pair, reference = target_only(arena)
        rounds = Rounds()
        options = {"temperature": temperature, "seed": 5} if temperature else {}
        result, _, _ = decode(
            pair, controller(), max_tokens=80, log=rounds, lookup=lookup, **options
        )
        texts.append(result.tokens)
        assert (rounds.lookups > 0) == (lookup is not None)
        assert all(report.lookup is not None or report.gamma == 0 for _, report in rounds.rounds)
        assert all(plan.round_s > 0 for plan, _ in rounds.rounds[3:])  # priced once measured
    assert texts[0] == texts[1]
    if not temperature:
        assert texts[0] == reference.greedy(PROMPT, 80)


def test_a_draft_length_without_a_draft_model_is_refused(arena) -> None:
    pair, _ = target_only(arena)
    with pytest.raises(ValueError, match="needs a draft model"):
        decode(pair, controller(), plan=Plan(3))

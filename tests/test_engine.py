"""The round loop on in-process workers: bookkeeping, plans, run-aheads, EOS, failures."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import msgspec
import numpy as np
import pytest
from fake_worker import VOCAB, FeatureCheckingDraft, InProcessWorker, TableModel

from hetspec.daemon.decode.engine import Decoder, WorkerPair
from hetspec.daemon.decode.requests import GenerateRequest, GenerationResult
from hetspec.daemon.decode.round_stats import SpeculativeStats
from hetspec.daemon.supervision.worker_client import WorkerError
from hetspec.protocol import worker_messages as m
from hetspec.protocol.arena import Arena
from hetspec.speculative.control.budget import BudgetController, Choice, ControllerConfig
from hetspec.speculative.control.core_choice import SpareCoreChoice
from hetspec.speculative.control.exploration import ExplorationState
from hetspec.speculative.control.rounds import NO_ONE_BESIDE, Beside, DraftCall, Plan, RoundReport

PROMPT = "def read(path):"


@pytest.fixture
def arena():
    arena = Arena.create(f"/dev/shm/hetspec-test-{uuid.uuid4().hex}", 2, 64 * 4 * 16 * VOCAB)
    yield arena
    arena.close()


def workers(arena, *, noise: float = 1.0, seed: int = 0, eos_bias: float = -4.0):
    target, draft = TableModel.pair(seed, noise, eos_bias)
    pair = WorkerPair(
        InProcessWorker("cpu", draft, arena),
        InProcessWorker("gpu", target, arena),
        arena,
        draft_slot=0,
        verify_slot=1,
    )
    reference, _ = TableModel.pair(seed, noise, eos_bias)
    return pair, reference


class ScriptedController(BudgetController):
    """The real controller's learning, with the plans a test names."""

    def __init__(self, plans: list[Plan]) -> None:
        super().__init__(ControllerConfig.of(max_width=63))
        self.script = list(plans)

    def choose(self, beside: Beside = NO_ONE_BESIDE) -> Choice:
        return Choice(
            self.script.pop(0) if len(self.script) > 1 else self.script[0], ExplorationState()
        )


def decode(pair, controller, *, plan=None, max_tokens=40, log=None, lookup=None, **options):
    request = GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, ignore_eos=True, **options)
    stats, result = SpeculativeStats(), GenerationResult()
    decoder = Decoder(request, pair, controller, stats, plan=plan, log=log, lookup=lookup)

    async def run() -> str:
        return "".join([piece async for piece in decoder.stream(result)])

    text = asyncio.run(run())
    return result, stats, text


FIXED = {
    "plain": Plan(3),
    "branches": Plan(2, 3),
    "overlapped": Plan(4, overlap=True),
    "rule": Plan(6, 4, rule=True),
    "alone": Plan(0),
}


@pytest.mark.parametrize("noise", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("kind", sorted(FIXED))
def test_greedy_output_is_the_targets_own_in_every_kind_of_round(arena, kind, noise) -> None:
    pair, reference = workers(arena, noise=noise)
    result, stats, text = decode(pair, BudgetController(), plan=FIXED[kind])
    assert result.tokens == reference.greedy(PROMPT, 40)
    assert text == "".join(reference.token_bytes(t).decode() for t in result.tokens)
    assert stats.rounds > 0
    assert set(stats.gammas) <= {FIXED[kind].gamma, 1, 2, 3, 4, 5, 6}


@pytest.mark.parametrize("overlap", [False, True])
def test_the_controllers_own_plans_keep_greedy_output_exact(arena, overlap) -> None:
    pair, reference = workers(arena, noise=0.5)
    controller = BudgetController(ControllerConfig.of(max_width=63, overlap=overlap))
    for _ in range(3):  # later requests start from what the earlier measured
        result, stats, _ = decode(pair, controller, max_tokens=60)
        assert result.tokens == reference.greedy(PROMPT, 60)
        msgspec.json.encode(stats.summary(controller))  # plain numbers: the API sends them


@pytest.mark.parametrize("kind", ["plain", "branches", "overlapped"])
def test_greedy_rounds_take_the_verifiers_argmax_alone_unless_logprobs_are_asked(arena, kind):
    """Greedy verification needs each row's argmax, not the rows (a large vocabulary's are
    megabytes a round); a request for log-probabilities still gets the rows."""
    asked, tokens = [], []
    for logprobs in (None, 2):
        pair, reference = workers(arena, noise=1.0)
        result, _, _ = decode(pair, BudgetController(), plan=FIXED[kind], logprobs=logprobs)
        calls = [c for c in pair.verifier.commands if isinstance(c, m.VerifyTree)]
        asked.append({c.argmax_only for c in calls})
        tokens.append(result.tokens)
    assert asked == [{True}, {False}]
    assert tokens[0] == tokens[1] == reference.greedy(PROMPT, 40)


@pytest.mark.parametrize("kind", ["plain", "branches", "overlapped", "rule"])
def test_a_seeded_request_takes_its_verdicts_in_the_verifier_with_the_same_text(arena, kind):
    """A sampled request's verdict is walked in the verifier (only the rows the walk reaches
    leave its runtime, nothing goes to the arena); with log-probabilities asked the rows still
    come, and the daemon's walk gives the same keyed text."""
    walks, tokens = [], []
    for logprobs in (None, 2):
        pair, _ = workers(arena, noise=1.0)
        arena.view(m.ArrayRef("<f4", (16, VOCAB), slot=1))[:] = np.nan
        result, _, _ = decode(
            pair, BudgetController(), plan=FIXED[kind], temperature=0.8, seed=3, logprobs=logprobs
        )
        calls = [c for c in pair.verifier.commands if isinstance(c, m.VerifyTree)]
        assert calls
        assert not any(c.argmax_only for c in calls)
        walks.append({(c.walk.keyed, c.walk.position > 0) if c.walk else None for c in calls})
        tokens.append(result.tokens)
        if logprobs is None:  # the slot held the prefill's one row, and no verification's
            assert np.isnan(arena.view(m.ArrayRef("<f4", (16, VOCAB), slot=1))[1:]).all()
    assert walks == [{(True, True)}, {None}]
    assert tokens[0] == tokens[1]
    assert len(set(np.diff(tokens[0]))) > 3  # not a degenerate loop


@pytest.mark.parametrize("kind", ["plain", "branches", "overlapped", "rule"])
def test_an_unseeded_request_walks_in_the_verifier_where_it_needs_no_row_after(arena, kind):
    """Drawn plain rounds send the draft's rows (in the drafter's slot) and a fresh seed a
    round for the verifier's walk; an overlapped round's second opinion reads the target's
    last row, so the daemon walks it as before."""
    pair, _ = workers(arena, noise=1.0)
    result, _, _ = decode(pair, BudgetController(), plan=FIXED[kind], temperature=0.8)
    calls = [c for c in pair.verifier.commands if isinstance(c, m.VerifyTree)]
    walks = [c.walk for c in calls]
    assert len(result.tokens) == 40
    if kind == "overlapped":
        assert walks == [None] * len(calls)
        return
    assert all(w is not None and not w.keyed and w.draft.slot == 0 for w in walks)
    assert all(len(w.draft_rows) == len(c.tokens) - 1 for w, c in zip(walks, calls, strict=True))
    assert len({w.seed for w in walks}) == len(walks)  # a new stream every round


@pytest.mark.parametrize("fault", [{"bonus": VOCAB}, {"path": [5]}, {"path": [1]}])
def test_a_walked_verdict_that_does_not_fit_its_tree_fails_the_request(arena, fault) -> None:
    """A verifier's walk that replies a bonus outside the vocabulary or nodes that are no path
    of the tree (a faulty worker) ends the request with an error, emitting nothing of it."""
    pair, _ = workers(arena)
    handlers = pair.verifier._worker.handlers
    verify = handlers[m.VerifyTree]

    def faulty(command, frames):
        reply, out = verify(command, frames)
        return msgspec.structs.replace(reply, **fault), out

    handlers[m.VerifyTree] = faulty
    with pytest.raises(WorkerError, match="does not fit the tree of 3 nodes") as failure:
        decode(pair, BudgetController(), plan=Plan(3), temperature=0.8, seed=1)
    assert failure.value.kind == "protocol"


@pytest.mark.parametrize("kind", ["plain", "overlapped", "alone"])
def test_a_requests_stats_say_where_its_rounds_went(arena, kind) -> None:
    """The daemon's own time a round and the calls' links (their time beyond the workers'
    own) are reported, and add up to no more than the decode time."""
    pair, _ = workers(arena, noise=1.0)
    result, stats, _ = decode(pair, BudgetController(), plan=FIXED[kind])
    summary = stats.summary(BudgetController())
    if kind == "alone":
        assert summary["t_verify_link_ms"] is None
        assert summary["t_draft_link_ms"] is None
        return
    overhead, verify_link = summary["t_overhead_ms"], summary["t_verify_link_ms"]
    assert overhead > 0
    assert verify_link >= 0
    assert (overhead + verify_link) * stats.rounds <= result.decode_ms
    if kind == "plain":  # an overlapped round's draft waits hide behind its verification
        assert summary["t_draft_link_ms"] >= 0
        assert stats.draft_calls == stats.rounds


class StartsAlone(ScriptedController):
    def decodes_alone(self) -> bool:
        return True


def test_a_late_drafter_prefill_is_its_own_wait_not_the_daemons_time(arena) -> None:
    """A request that starts decoding alone prefills the drafter with its first draft: that
    round waits for the prefill (50 ms here), reported apart from the daemon's own time."""
    pair, reference = workers(arena, noise=1.0)
    pair.drafter.delays[m.Prefill] = 0.05
    controller = StartsAlone([Plan(0), *[Plan(3)] * 200])
    result, stats, _ = decode(pair, controller, max_tokens=200)
    assert result.tokens == reference.greedy(PROMPT, 200)
    assert stats.drafted > 0
    summary = stats.summary(controller)
    assert summary["t_prefill_wait_ms"] * stats.rounds >= 45
    assert summary["t_overhead_ms"] * stats.rounds < 45


class Recording(ScriptedController):
    def __init__(self, plans: list[Plan]) -> None:
        super().__init__(plans)
        self.reports: list[RoundReport] = []

    def observe(self, report: RoundReport) -> None:
        self.reports.append(report)
        super().observe(report)


def test_trials_of_the_other_core_choice_do_not_price_the_target_alone(arena) -> None:
    """Every other call of the target alone tries the core choice not preferred (two
    tokens, maybe twice as slow): those rounds, like a transition from drafting, report no
    cost of decoding alone, so one of them cannot price the target alone for good."""
    pair, reference = workers(arena)
    pair = dataclasses.replace(pair, alone_cores=SpareCoreChoice(explore_every=2, recheck_every=2))
    controller = Recording([Plan(2), Plan(0)])
    for _ in range(8):  # a call decodes every token a request has left: short requests
        result, _, _ = decode(pair, controller, max_tokens=12)
        assert result.tokens == reference.greedy(PROMPT, 12)
    alone = [r for r in controller.reports if r.gamma == 0]
    trials = [r for r in alone if r.alone_compute_s is None]
    priced = [r for r in alone if r.alone_round_s is not None]
    assert len(trials) >= 3
    assert all(r.alone_round_s is None for r in trials)
    assert priced
    assert len(priced) + len(trials) <= len(alone)
    assert alone[0].alone_round_s is None  # a transition from drafting
    assert len(controller.estimates._alone) == len(priced)


def test_a_run_ahead_is_kept_when_the_draft_holds_and_dropped_when_it_misses(arena) -> None:
    pair, _ = workers(arena, noise=0.0)  # the drafter predicts the target exactly
    _, held, _ = decode(pair, BudgetController(), plan=Plan(3, overlap=True))
    assert held.run_ahead_held >= held.rounds - 2
    pair, _ = workers(arena, noise=3.0)
    _, missed, _ = decode(pair, BudgetController(), plan=Plan(3, overlap=True))
    assert missed.run_ahead_held < missed.rounds // 2


def test_a_kept_run_ahead_does_not_override_the_next_plan(arena) -> None:
    """An overlapped round whose run-ahead held, then plans without overlap: the target
    alone, then branches. Each round runs as planned; the run-ahead is dropped."""
    pair, reference = workers(arena, noise=0.0)
    plans = [Plan(3, overlap=True), Plan(0), Plan(0), Plan(2, 2), Plan(3, overlap=True)]
    result, stats, _ = decode(pair, ScriptedController(plans), max_tokens=400)
    assert stats.gammas[:4] == [3, 0, 0, 2]
    assert stats.branches[3] == 2
    assert result.tokens == reference.greedy(PROMPT, 400)


def test_choosing_ahead_commits_nothing_for_a_round_that_never_runs(arena) -> None:
    pair, _ = workers(arena)
    controller = BudgetController(ControllerConfig.of(max_width=63))
    _, stats, _ = decode(pair, controller, max_tokens=25)
    assert len(controller.history) == stats.rounds  # every committed plan ran


def test_a_requests_draft_time_is_its_own(arena) -> None:
    """The controller also holds other requests' measurements (here: a 1 s draft step);
    a request's statistics give its own drafts' time."""
    pair, _ = workers(arena)
    controller = BudgetController()
    for _ in range(5):
        controller.observe(
            RoundReport(
                1, 1, 0, drafts=(DraftCall(1, 1, 1.0, 0.0),), verify_width=2, verify_s=0.001
            )
        )
    _, stats, _ = decode(pair, controller, plan=Plan(3), max_tokens=6)
    summary = stats.summary(controller)
    assert summary["controller"]["draft_step_ms"]["plain"] >= 1000 / 3
    assert stats.draft_steps > 0
    assert 0 <= summary["t_draft_ms"] < 100


@pytest.mark.parametrize("kind", sorted(FIXED))
def test_eos_in_mid_round_ends_the_output_before_it(arena, kind) -> None:
    pair, reference = workers(arena, noise=0.5, seed=3, eos_bias=4.0)
    expected = reference.greedy(PROMPT, 60)
    assert reference.eos in expected[1:], "the fixture must reach EOS after the first token"
    request = GenerateRequest(prompt=PROMPT, max_tokens=60)
    result, stats = GenerationResult(), SpeculativeStats()
    decoder = Decoder(request, pair, BudgetController(), stats, plan=FIXED[kind])

    async def run() -> None:
        async for _ in decoder.stream(result):
            pass

    asyncio.run(run())
    assert result.tokens == expected[: expected.index(reference.eos)]
    assert result.done_reason == "stop"


@pytest.mark.parametrize("failing", [m.VerifyTree, m.Draft])
@pytest.mark.parametrize("kind", ["plain", "overlapped"])
def test_a_worker_failing_mid_round_fails_the_request_and_leaves_no_call(arena, kind, failing):
    pair, _ = workers(arena)
    worker = pair.verifier if failing is m.VerifyTree else pair.drafter
    worker.fail_on, worker.fail_after = failing, 3
    request = GenerateRequest(prompt=PROMPT, max_tokens=60, ignore_eos=True)
    result = GenerationResult()
    decoder = Decoder(request, pair, BudgetController(), SpeculativeStats(), plan=FIXED[kind])

    async def run() -> set:
        with pytest.raises(WorkerError, match="on purpose"):
            async for _ in decoder.stream(result):
                pass
        await asyncio.sleep(0.01)
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(run()) == set()
    assert 0 < len(result.tokens) < 60


@pytest.mark.parametrize("kind", ["plain", "overlapped"])
def test_cancelling_a_request_mid_round_leaves_no_call_running(arena, kind) -> None:
    """A plain round's next draft is already out when its tokens stream (an overlapped
    one's run-ahead while it verifies): cancelled with the request."""
    pair, _ = workers(arena)
    request = GenerateRequest(prompt=PROMPT, max_tokens=300, ignore_eos=True)
    result = GenerationResult()
    decoder = Decoder(
        request,
        pair,
        BudgetController(),
        SpeculativeStats(),
        plan=dataclasses.replace(FIXED[kind], gamma=3),
    )

    async def run() -> set:
        async def consume() -> None:
            async for _ in decoder.stream(result):
                pass

        task = asyncio.create_task(consume())
        while len(result.tokens) < 20 and not task.done():
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(run()) == set()
    assert 20 <= len(result.tokens) < 300


@pytest.mark.parametrize("kind", ["plain", "branches", "rule"])
def test_the_next_draft_goes_out_before_a_rounds_tokens_stream(arena, kind) -> None:
    """Where the next round's plan is known (fixed here, or chosen ahead), its draft is sent
    as soon as a round's tokens are: the drafter drafts while the daemon reports the round
    and streams them out. The round that reaches the request's end sends none."""
    pair, reference = workers(arena, noise=0.5)
    request = GenerateRequest(prompt=PROMPT, max_tokens=40, ignore_eos=True)
    result, stats = GenerationResult(), SpeculativeStats()
    decoder = Decoder(request, pair, BudgetController(), stats, plan=FIXED[kind])
    seen = []  # at each piece: rounds run, drafts sent, tokens so far

    async def run() -> None:
        async for _ in decoder.stream(result):
            drafts = sum(isinstance(c, m.Draft) for c in pair.drafter.commands)
            seen.append((stats.rounds, drafts, len(result.tokens)))

    asyncio.run(run())
    assert result.tokens == reference.greedy(PROMPT, 40)
    streamed_mid = [
        (rounds, drafts) for rounds, drafts, tokens in seen if rounds > 0 and tokens < 40
    ]
    assert len(streamed_mid) >= 3
    assert all(drafts == rounds + 1 for rounds, drafts in streamed_mid)
    drafts = sum(isinstance(c, m.Draft) for c in pair.drafter.commands)
    assert drafts == stats.rounds  # none sent for a round that never ran
    # each draft sent after a verification was announced when its reply came (the drafter
    # then waits awake through the verdict); an announcement is followed by a draft, but
    # the last round's, which found the request at its end
    commands, announced = pair.drafter.commands, pair.drafter.announced
    assert drafts - 1 <= len(announced) <= drafts
    assert all(isinstance(commands[n], m.Draft) for n in announced if n < len(commands))


def test_a_draft_sent_for_a_round_that_never_runs_leaves_the_pair_as_it_was(arena) -> None:
    """A stop string ends a request while the next round's draft is out: the next request
    on the same workers still gets the target's own tokens, and no call is left running."""
    pair, reference = workers(arena, noise=0.5)
    expected = reference.greedy(PROMPT, 40)
    text = [reference.token_bytes(t).decode() for t in expected]
    stop = text[12] + text[13]
    assert stop
    assert stop not in "".join(text[:12]) + text[12][:-1], "a stop the fixture reaches"

    async def run() -> set:
        for stops in ([stop], []):
            request = GenerateRequest(prompt=PROMPT, max_tokens=40, ignore_eos=True, stop=stops)
            result = GenerationResult()
            decoder = Decoder(request, pair, BudgetController(), SpeculativeStats(), plan=Plan(3))
            async for _ in decoder.stream(result):
                pass
            outputs.append(result.tokens)
        await asyncio.sleep(0.01)
        return asyncio.all_tasks() - {asyncio.current_task()}

    outputs = []
    assert asyncio.run(run()) == set()
    assert len(outputs[0]) < 30
    assert outputs[0] == expected[: len(outputs[0])]
    assert outputs[1] == expected


def test_a_rounds_overhead_counts_the_time_between_its_calls_outside_it(arena) -> None:
    """A round's period runs from the previous round's report to its own: what the daemon
    does between rounds (here a client that takes 5 ms a piece) is priced as overhead, not
    lost, where it does not overlap a draft."""
    pair, _ = workers(arena, noise=0.5)
    request = GenerateRequest(prompt=PROMPT, max_tokens=40, ignore_eos=True)
    controller = Recording([Plan(3)])
    decoder = Decoder(request, pair, controller, SpeculativeStats())

    async def run() -> None:
        async for _ in decoder.stream(GenerationResult()):
            await asyncio.sleep(0.005)

    asyncio.run(run())
    overheads = sorted(r.overhead_s for r in controller.reports[1:] if r.gamma)
    assert len(overheads) >= 5
    assert overheads[len(overheads) // 2] >= 0.004


def test_the_rules_would_be_k_is_the_same_beside_a_gpu_verification(arena) -> None:
    """Beside a verifier off the CPU the daemon weighs the rule's would-be k from the
    draft's rows while the verification runs, not after it: the same k every round."""
    picked = []
    for device in ("cpu", "cuda:0"):
        pair, reference = workers(arena, noise=1.0)
        pair.verifier.ready = msgspec.structs.replace(pair.verifier.ready, device=device)
        assert pair.verifier_on_cpu == (device == "cpu")
        controller = Recording([Plan(4)])
        result, _, _ = decode(pair, controller)
        assert result.tokens == reference.greedy(PROMPT, 40)
        picked.append([r.rule_k for r in controller.reports if r.gamma])
    assert picked[0] == picked[1]
    assert any(k is not None and k > 1 for k in picked[0])


class WeighingLog(ScriptedController):
    """Scripted plans, noting at each ``choose`` which worker calls were in flight: the
    commands each worker took, less the replies the engine had awaited."""

    def __init__(self, pair: WorkerPair, plans: list[Plan]) -> None:
        super().__init__(plans)
        self.in_flight: list[set[str]] = []
        self.pending: set[str] = set()
        for worker in (pair.drafter, pair.verifier):
            self._watch(worker)

    def _watch(self, worker) -> None:
        posted, called = worker.post, worker.call

        def post(command, arrays=()):
            name = type(command).__name__
            self.pending.add(name)
            reply = posted(command, arrays)

            async def answer():
                try:
                    return await reply
                finally:
                    self.pending.discard(name)

            return answer()

        async def call(command, arrays=()):
            name = type(command).__name__
            self.pending.add(name)
            try:
                return await called(command, arrays)
            finally:
                self.pending.discard(name)

        worker.post, worker.call = post, call

    def choose(self, beside: Beside = NO_ONE_BESIDE) -> Choice:
        self.in_flight.append(set(self.pending))
        return super().choose(beside)


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_the_next_plan_is_weighed_beside_the_longer_call_of_a_round(arena, device) -> None:
    """Beside a verifier on the CPU the next plan is weighed while the draft runs (the
    verification may borrow the drafter's cores); beside one off the CPU, while the
    verification runs, where a GPU box's early draft was often done before the weighing.
    Either way every round's plan is chosen ahead and the output stays the target's."""
    pair, reference = workers(arena, noise=1.0)
    pair.verifier.ready = msgspec.structs.replace(pair.verifier.ready, device=device)
    controller = WeighingLog(pair, [Plan(3), Plan(2, 2), Plan(4)])
    result, _, _ = decode(pair, controller, max_tokens=60)
    assert result.tokens == reference.greedy(PROMPT, 60)
    beside = [calls for calls in controller.in_flight if calls in ({"Draft"}, {"VerifyTree"})]
    assert len(beside) >= 10
    expected = {"Draft"} if device == "cpu" else {"VerifyTree"}
    assert all(calls == expected for calls in beside), controller.in_flight


def test_sampled_rounds_draw_from_the_request_seed(arena) -> None:
    """Same seed, same plan: the same tokens (the drafter's and the verifier's streams are
    both seeded by the request)."""
    runs = []
    for _ in range(2):
        pair, _ = workers(arena)
        result, _, _ = decode(
            pair, BudgetController(), plan=Plan(3, overlap=True), temperature=0.8, seed=7
        )
        runs.append(result.tokens)
    assert runs[0] == runs[1]
    assert len(set(np.diff(runs[0]))) > 3  # not a degenerate loop


HEAD_PLANS = {
    **{kind: [plan] for kind, plan in FIXED.items() if kind != "alone"},
    "mixed": [
        Plan(3),
        Plan(0),
        Plan(0),
        Plan(4, overlap=True),
        Plan(2, 3),
        Plan(0),
        Plan(3),
        Plan(6, 4, rule=True),
        Plan(3, overlap=True),
    ],
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", sorted(HEAD_PLANS))
def test_a_draft_head_gets_the_targets_feature_before_every_token(kind, temperature) -> None:
    """The verifier reports features (here each position's (position, token)); the drafter
    (checking every row it gets) receives the prompt's with its prefill and, with every
    append, the feature of the position before each appended token, in every kind of round."""
    arena = Arena.create(f"/dev/shm/hetspec-test-{uuid.uuid4().hex}", 3, 64 * 4 * 16 * VOCAB)
    try:
        target, draft = TableModel.pair(0, 1.0)
        checking = FeatureCheckingDraft((draft.last_table, draft.prev_table, draft.position_table))
        drafter, verifier = (
            InProcessWorker("gpu", checking, arena),
            InProcessWorker("cpu", target, arena),
        )
        pair = WorkerPair(drafter, verifier, arena, draft_slot=0, verify_slot=1, feature_slot=2)
        reference, _ = TableModel.pair(0, 1.0)
        plans = HEAD_PLANS[kind] * 30
        options = {"temperature": temperature, "seed": 7} if temperature else {}
        result, _, _ = decode(pair, ScriptedController(plans), max_tokens=120, **options)
        if not temperature:
            assert result.tokens == reference.greedy(PROMPT, 120)
        appends = [c for c in drafter.commands if isinstance(c, m.Draft) and c.append]
        prefills = [c for c in drafter.commands if isinstance(c, m.Prefill)]
        assert appends
        assert all(c.features is not None for c in appends)
        assert prefills[0].features is not None
        assert checking.features_checked >= len(PROMPT) + sum(len(c.append) for c in appends)
    finally:
        arena.close()


def test_a_branched_round_reports_what_its_first_branch_kept_as_a_chain_would(arena) -> None:
    """The first branch holds the draft's own choices: it keeps what a one-branch round
    drafted at the same place keeps, whichever branch the target followed (the controller
    learns chains' acceptance from it while it drafts branches)."""
    later_branch_won = 0
    for seed in range(8):
        first_rounds = {}
        for plan in (Plan(4), Plan(4, 3)):
            pair, _ = workers(arena, noise=2.0, seed=seed)
            reports: list[RoundReport] = []
            decode(
                pair,
                BudgetController(),
                plan=plan,
                max_tokens=8,
                log=lambda _plan, report, into=reports, **_: into.append(report),
            )
            first_rounds[plan.branches] = reports[0]
        chain, branched = first_rounds[1], first_rounds[3]
        assert chain.first_branch_accepted is None
        assert branched.first_branch_accepted == chain.accepted
        assert branched.accepted >= chain.accepted
        later_branch_won += branched.accepted > 0 and branched.first_branch_accepted == 0
    assert later_branch_won  # the seeds cover a round won by a later branch

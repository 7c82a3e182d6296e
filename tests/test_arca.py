"""ARCA on synthetic profiles: the split only where it pays, never slower than unsplit at the
same width, the paper's ratio search, and the profile cache's refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hetspec.speculative.control.arca import (
    Identity,
    Profile,
    ProfileMismatch,
    best_ratio,
    choose,
    decide,
    initial_ratio,
    load_costs,
    load_profile,
    ratios_by_width,
    refine_ratio,
    save_costs,
    save_profile,
)

RATIOS = [0.0, 0.25, 0.5, 0.75, 1.0]
EMITTED = {(1, "chain"): 1.0, (4, "chain"): 2.2, (4, "tree"): 2.4, (16, "tree"): 3.0}


def costs(gpu_ms, cpu_ms, *, contention: float = 0.0) -> dict[tuple[int, float], float]:
    """Two sides at once: the slower share's time, plus a toll where both work."""
    table = {}
    for width in (1, 4, 16):
        for r in RATIOS:
            both = 0.0 < r < 1.0
            table[width, r] = max(r * gpu_ms(width), (1 - r) * cpu_ms(width)) + both * contention
    return table


def test_where_the_split_does_not_pay_the_unsplit_is_chosen() -> None:
    # a GPU far faster than the CPU and a toll on every split forward
    profile = Profile(costs(lambda w: 10.0, lambda w: 200.0 + 10 * w, contention=5.0), EMITTED)
    choice = choose(profile)
    assert choice.ratio == 1.0
    assert choice.gain == 1.0
    assert (choice.width, choice.tree) == (16, "tree")  # flat GPU cost: the widest pays


def test_where_the_split_pays_it_is_chosen_with_its_width() -> None:
    # a compute-bound GPU (cost grows with width) and a CPU of similar speed
    profile = Profile(costs(lambda w: 10.0 * w, lambda w: 12.0 * w), EMITTED)
    choice = choose(profile)
    assert choice.ratio == 0.5
    assert choice.gain == pytest.approx(10.0 / 6.0)
    assert (choice.width, choice.tree) == (1, "chain")  # cost linear in width: one token
    assert choice.tokens_per_s == pytest.approx(1000.0 / 6.0)


@pytest.mark.parametrize("seed", range(20))
def test_never_slower_than_the_best_unsplit_at_the_same_width(seed) -> None:
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    table = {(w, r): rng.uniform(1, 100) for w in (1, 4, 16) for r in RATIOS}
    choice = choose(Profile(table, EMITTED))
    for width in (1, 4, 16):
        _, ms = best_ratio(table, width)
        assert ms <= min(table[width, 0.0], table[width, 1.0])
    assert choice.tokens_per_s >= choice.unsplit_tokens_per_s
    best_unsplit = max(
        1000 * n / min(table[w, 0.0], table[w, 1.0]) for (w, _), n in EMITTED.items()
    )
    assert choice.tokens_per_s >= best_unsplit


def test_a_width_without_an_unsplit_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="no unsplit cost"):
        choose(Profile({(4, 0.5): 1.0}, {(4, "chain"): 2.0}))


def test_the_ratio_search_starts_from_the_sides_alone_and_steps_to_the_cheapest() -> None:
    gpu_ms, cpu_ms = 30.0, 90.0  # the GPU three times as fast
    assert initial_ratio(gpu_ms, cpu_ms) == pytest.approx(0.75)

    def measure(r: float) -> float:  # contention moves the balance point to 0.64
        return max(r * gpu_ms * 1.5, (1 - r) * cpu_ms * 0.9)

    tried = refine_ratio(measure, initial_ratio(gpu_ms, cpu_ms), step=0.05)
    assert {0.0, 1.0} <= set(tried)
    assert best_ratio({(1, r): ms for r, ms in tried.items()}, 1)[0] == 0.65
    assert len(tried) < 12  # a walk, not a sweep of all 21 ratios


# ------------------------------------------------------------ the cache


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "arca.json"
    identity = Identity(model="m1", box="box-a")
    profile = Profile(costs(lambda w: 10.0 * w, lambda w: 12.0 * w), EMITTED)
    save_profile(path, identity, profile)
    return path, identity, profile


def test_the_cache_gives_back_the_profile_and_choice(saved) -> None:
    path, identity, profile = saved
    loaded, choice = load_profile(path, identity)
    assert loaded == profile
    assert choice == choose(profile)
    decision = decide(path, identity, unsplit_ratio=1.0)
    assert decision.ratio == 0.5
    assert decision.refused is None


@pytest.mark.parametrize(
    ("identity", "field"),
    [(Identity("m1", "box-b"), "box"), (Identity("m2", "box-a"), "model")],
)
def test_a_cache_of_another_box_or_model_is_refused_in_one_line(saved, identity, field) -> None:
    path, _, _ = saved
    with pytest.raises(ProfileMismatch, match=f"profile made for {field}"):
        load_profile(path, identity)
    decision = decide(path, identity, unsplit_ratio=1.0)
    assert decision.ratio == 1.0
    assert decision.choice is None
    assert decision.refused.endswith("verifying unsplit")
    assert "\n" not in decision.refused


def test_a_damaged_or_missing_cache_means_unsplit(saved, tmp_path) -> None:
    path, identity, _ = saved
    record = json.loads(path.read_text())
    del record["cost_ms"]
    path.write_text(json.dumps(record))
    assert "not an ARCA profile" in decide(path, identity, unsplit_ratio=0.0).refused
    missing = decide(tmp_path / "none.json", identity, unsplit_ratio=0.0)
    assert (missing.ratio, missing.choice, missing.refused) == (0.0, None, None)


def test_a_verifiers_costs_alone_give_each_width_its_cheapest_ratio(tmp_path) -> None:
    """What a verifier measures at load without the draft: costs, no acceptance."""
    table = costs(lambda w: 10.0 * w, lambda w: 12.0 * w)
    path = tmp_path / "arca" / "costs.json"
    identity = Identity(model="m1", box="box-a")
    save_costs(path, identity, table)
    assert [p.name for p in path.parent.iterdir()] == ["costs.json"]  # nothing half-written
    assert load_costs(path, identity) == table
    assert ratios_by_width(table) == {w: best_ratio(table, w)[0] for w in (1, 4, 16)}
    with pytest.raises(ProfileMismatch, match="profile made for box 'box-a'"):
        load_costs(path, Identity(model="m1", box="box-b"))
    del table[4, 0.0], table[4, 1.0]
    save_costs(path, identity, table)
    with pytest.raises(ProfileMismatch, match=r"not an ARCA profile .*no unsplit cost"):
        load_costs(path, identity)


@pytest.mark.process
def test_arca_imports_without_torch() -> None:
    code = (
        "import sys, hetspec.speculative.control.arca, hetspec.speculative.control.unified_board\n"
    )
    code += "assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)

"""The round log: every speculative round as a JSON line, and its summary."""

from __future__ import annotations

import functools

import pytest
from test_engine import PROMPT, decode, workers

from hetspec.daemon.decode import round_log
from hetspec.daemon.decode.round_log import RoundLog
from hetspec.speculative.control.budget import BudgetController, ControllerConfig
from hetspec.speculative.control.rounds import Plan


def test_each_round_is_a_line_with_its_plan_report_and_time(arena, tmp_path) -> None:
    pair, reference = workers(arena, noise=0.5)
    path = tmp_path / "rounds.jsonl"
    log = RoundLog(path)
    controller = BudgetController(ControllerConfig.of(max_width=63))
    result, stats, _ = decode(
        pair, controller, max_tokens=60, log=functools.partial(log.write, "run-1", "adaptive")
    )
    log.close()
    assert result.tokens == reference.greedy(PROMPT, 60)
    lines = round_log.read(path)
    assert len(lines) == stats.rounds
    assert {line.run for line in lines} == {"run-1"}
    assert sum(line.emitted for line in lines) == 60 - 1  # the first token is the prefill's
    assert [line.report.gamma for line in lines] == stats.gammas
    assert all(line.seconds > 0 for line in lines)
    assert [line.plan for line in lines] == controller.history  # as chosen, expectations too
    table = round_log.summary(lines)
    assert "| adaptive | 1 |" in table


def test_a_line_cut_short_is_skipped_and_a_missing_file_is_one_clear_line(
    arena, tmp_path, capsys
) -> None:
    pair, _ = workers(arena)
    path = tmp_path / "rounds.jsonl"
    log = RoundLog(path)
    _, stats, _ = decode(
        pair, BudgetController(), max_tokens=20, log=functools.partial(log.write, "r", "sequential")
    )
    log.close()
    with path.open("ab") as file:
        file.write(b'{"t": 1.0, "run": "r", "mo')  # a crash mid-line
    assert len(round_log.read(path)) == stats.rounds
    assert round_log.main([str(path)]) == 0
    assert "| sequential |" in capsys.readouterr().out
    assert round_log.main([str(tmp_path / "missing.jsonl")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_a_round_log_that_cannot_be_opened_says_which_and_why(tmp_path) -> None:
    with pytest.raises(OSError, match=r"cannot open round_log .*missing/rounds.jsonl: No such"):
        RoundLog(tmp_path / "missing" / "rounds.jsonl")


def test_the_summary_tells_each_kind_of_round_apart(arena, tmp_path) -> None:
    """Per mode and kind: its rounds, its share of the mode's time, tokens kept a round."""
    path = tmp_path / "rounds.jsonl"
    log = RoundLog(path)
    for plan, mode in ((Plan(3), "sequential"), (Plan(2, 2), "sequential"), (Plan(0), "adaptive")):
        pair, _ = workers(arena, noise=0.5)
        decode(
            pair,
            BudgetController(),
            plan=plan,
            max_tokens=20,
            log=functools.partial(log.write, "run", mode),
        )
    log.close()
    lines = round_log.read(path)
    rows = {
        tuple(cell.strip() for cell in row.split("|")[1:4]): row
        for row in round_log.kinds(lines).splitlines()[2:]
    }
    counted = {kind: int(rounds) for (mode, kind, rounds) in rows if mode == "sequential"}
    assert counted == {
        "chain": sum(1 for line in lines if line.mode == "sequential" and line.plan.branches == 1),
        "2 branches": sum(1 for line in lines if line.plan.branches == 2),
    }
    (alone,) = [row for (_, kind, _), row in rows.items() if kind == "alone"]
    assert alone.startswith("| adaptive | alone |")
    assert "| 100% |" in alone  # the mode's only kind
    assert sum(line.emitted for line in lines if line.plan.branches == 2) > 0

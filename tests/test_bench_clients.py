"""hetspec bench --clients (hetspec.bench.parallel_clients): several clients at once, end to
end small, and its figures and goals from made-up runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetspec.bench import parallel_clients as clients


@pytest.mark.process
def test_clients_bench_measures_every_count_and_a_missing_peer_is_a_row(tmp_path: Path) -> None:
    """The smallest run on the bundled models: 1 and 2 clients, 5 requests a run (1 code and
    4 chat prompts), one pass, no llama-server binary: every hetspec row measured with every
    request's tokens equal to its prompt's run alone, the peer's rows saying why they are
    missing, the goals' lines, the JSON of every request, and no traceback."""
    missing = tmp_path / "no-llama-server"
    document = tmp_path / "clients.json"
    command = [
        sys.executable,
        "-m",
        "hetspec.client.cli",
        "bench",
        "--clients",
        "1,2",
        "--target",
        "bundled",
        "--prompts",
        "1",
        "--repeats",
        "1",
        "--max-tokens",
        "8",
        "--llama-server",
        str(missing),
        "--json",
        str(document),
        "--logs",
        str(tmp_path / "logs"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    table = done.stdout
    assert table.startswith("# Several clients at once")
    assert "`hetspec bench --clients 1,2 --target bundled" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    batched = clients.daemon_knows_max_parallel()
    for count, mine in ((1, "hetspec max_parallel=2"), (2, "hetspec max_parallel=2")):
        one = next(r for r in rows if r.startswith(f"| {count} | {clients.ONE_AT_A_TIME} |"))
        assert one.split("|")[8].strip() == "5/5", one  # tokens = alone
        row = next(r for r in rows if r.startswith(f"| {count} | {mine} |"))
        assert row.split("|")[8].strip() == ("5/5" if batched else "-"), row
        peer = next(r for r in rows if r.startswith(f"| {count} | llama-server -np {count} |"))
        assert f"skipped: no llama-server: no llama-server at {missing}" in peer
    assert "- 1 client, aggregate against hetspec one at a time: " in table
    assert "- tokens of every hetspec request = its run alone: " in table
    written = json.loads(document.read_text())
    target = written["targets"][0]
    assert target["target"] == "bundled"
    measured = [r for r in target["rows"] if "error" not in r]
    assert {r["system"] for r in measured} >= {clients.ONE_AT_A_TIME}
    assert all(r["same_as_alone"] == [5, 5] for r in measured)
    runs = target["runs"]
    assert {(r["clients"], r["system"]) for r in runs} >= {(1, clients.ONE_AT_A_TIME)}
    assert all(len(q["tokens"]) == 8 for r in runs for q in r["requests"])
    assert all(len(r["requests"]) == 5 for r in runs)


def _run(system: str, count: int, seconds: float, tokens: int = 8) -> clients.Run:
    """A pass of ``count`` requests, ``tokens`` each, all sent at 0 and done at ``seconds``."""
    requests = [
        clients.Request(i, list(range(tokens)), 0.0, seconds / 4, seconds) for i in range(count)
    ]
    return clients.Run(system, 4, 0, requests)


def test_figures_and_goals_are_ratios_of_medians_and_unmeasured_ones_say_so() -> None:
    alone = {i: list(range(8)) for i in range(8)}
    rows = {
        (4, "hetspec max_parallel=4"): clients.summary(
            [_run("b", 8, 1.0), _run("b", 8, 0.5), _run("b", 8, 2.0)], alone
        ),
        (4, clients.ONE_AT_A_TIME): clients.summary([_run("o", 8, 2.0)], alone),
        (4, "llama-server -np 4 speculative n-max=3 p-min=0.0"): clients.summary(
            [_run("l", 8, 4.0)],
            None,  # its own tokens alone unknown: not compared
        ),
        (1, clients.ONE_AT_A_TIME): {"error": "failed: RequestFailed: no"},
    }
    batched = rows[4, "hetspec max_parallel=4"]
    assert batched["aggregate_tokens_per_s"] == 64.0  # 64 tokens in 1 s, the median pass
    assert batched["aggregate_range"] == (32.0, 128.0)
    assert batched["same_as_alone"] == (24, 24)
    lines = clients.goals(rows)
    assert lines[0] == (
        "- 4 clients, aggregate against hetspec one at a time: 2.00x (goal >= 1.6x); against "
        "llama-server -np 4 with its best speculative decoding 4.00x (goal >= 2.5x)"
    )
    assert lines[1] == (
        "- 4 clients, latency p50 against hetspec one at a time's: 0.50x (goal <= 0.75x)"
    )
    assert "not measured" in lines[2]  # no 8 clients
    assert "not measured" in lines[3]  # 1 client: one at a time failed
    assert lines[4] == "- tokens of every hetspec request = its run alone: 32/32 (goal: all)"
    assert len(lines) == 5  # nothing said of llama-server's tokens, never compared
    table = clients.table(rows)
    peer = table[4].split("|")
    assert [c.strip() for c in peer[6:10]] == ["4000", "1000", "-", "-"]  # p99, TTFT; unknown
    assert "| 1 | hetspec one at a time | failed: RequestFailed: no | - |" in table[-1]
    assert clients.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.99) == pytest.approx(4.96)
    assert clients.shares(8, 3) == [[0, 3, 6], [1, 4, 7], [2, 5]]


class _Session:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def send(self, prompt: str, max_tokens: int, index: int) -> clients.Request:
        if self.fail and index == 1:
            raise clients.RequestFailed("the server broke off\nmore lines")
        return clients.Request(index, [0] * max_tokens, 0.0, 0.1, 0.2)

    def close(self) -> None:
        pass


def test_a_failed_request_makes_its_run_an_error_line_not_a_traceback() -> None:
    prompts = ["a", "b", "c", "d"]
    good = clients.fire(clients.System("s", lambda: _Session(False)), prompts, 2, 4)
    assert good.error == ""
    assert sorted(r.prompt for r in good.requests) == [0, 1, 2, 3]
    bad = clients.fire(clients.System("s", lambda: _Session(True)), prompts, 2, 4)
    assert bad.error == "RequestFailed: the server broke off"
    assert bad.requests == []

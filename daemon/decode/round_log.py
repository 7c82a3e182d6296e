"""Every speculative round as one JSON line, for diagnosing the controller on a real box.

Off unless the ``round_log`` setting names a file. A line holds the request's id and mode,
the plan the round ran with what the controller expected of it (``expected_tokens``,
``round_s``; a request's fixed gamma expects nothing), and the round's report: what it
drafted, accepted and cost (``speculative/control/rounds.py``). ``python -m
hetspec.daemon.decode.round_log FILE`` summarizes a file: per mode, then per mode and kind of
round (chains, branches, the rule's, overlapped, the target alone).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import msgspec

from hetspec.speculative.control.rounds import Plan, RoundReport


class RoundLine(msgspec.Struct, kw_only=True):
    t: float  # wall-clock seconds when the round ended
    run: str
    mode: str
    plan: Plan
    report: RoundReport
    seconds: float  # the round's wall-clock time, as the request saw it
    emitted: int  # tokens the round gave the request


class RoundLog:
    """Appends rounds to ``path`` (created if missing; its folder must exist), a write a
    round: each line is in the file once its round ends, whatever becomes of the daemon."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file = self.path.open("ab", buffering=0)
        except OSError as error:
            raise OSError(f"cannot open round_log {path}: {error.strerror}") from None
        self._encoder = msgspec.json.Encoder()

    def write(
        self, run: str, mode: str, plan: Plan, report: RoundReport, *, seconds: float, emitted: int
    ) -> None:
        line = RoundLine(
            t=time.time(),
            run=run,
            mode=mode,
            plan=plan,
            report=report,
            seconds=seconds,
            emitted=emitted,
        )
        self._file.write(self._encoder.encode(line) + b"\n")

    def close(self) -> None:
        self._file.close()


def read(path: str | Path) -> list[RoundLine]:
    """The rounds of a round log (a line cut short by a crash is skipped)."""
    decoder = msgspec.json.Decoder(RoundLine)
    lines = []
    for raw in Path(path).read_bytes().splitlines():
        try:
            lines.append(decoder.decode(raw))
        except msgspec.DecodeError:
            continue
    return lines


def summary(lines: list[RoundLine]) -> str:
    """Per mode: requests, rounds, tokens, and the controller's expected tokens per second
    against what the same rounds gave (its drafted rounds with an expectation)."""
    by_mode: dict[str, list[RoundLine]] = defaultdict(list)
    for line in lines:
        by_mode[line.mode].append(line)
    rows = [
        "| mode | requests | rounds | alone rounds | tokens | mean gamma drafted | "
        "accepted a drafted round | expected tokens/s | measured tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, mode_lines in sorted(by_mode.items()):
        drafted = [line for line in mode_lines if line.report.gamma]
        priced = [line for line in drafted if line.plan.round_s > 0]
        expected = measured = "-"
        if priced:
            tokens = sum(line.plan.expected_tokens for line in priced)
            expected = f"{tokens / sum(line.plan.round_s for line in priced):.1f}"
            spent = sum(line.seconds for line in priced)
            measured = f"{sum(line.emitted for line in priced) / spent:.1f}"
        gamma = _mean([line.report.gamma for line in drafted])
        accepted = _mean([line.report.accepted for line in drafted])
        rows.append(
            f"| {mode} | {len({line.run for line in mode_lines})} | {len(mode_lines)} | "
            f"{len(mode_lines) - len(drafted)} | "
            f"{sum(line.emitted for line in mode_lines)} | {gamma} | {accepted} | "
            f"{expected} | {measured} |"
        )
    return "\n".join(rows)


def kind_of(line: RoundLine) -> str:
    """A round's kind, as the controller weighs them."""
    plan = line.plan
    if not plan.gamma:
        return "alone"
    if plan.rule:
        return "rule"
    if plan.overlap:
        return "overlapped"
    return "chain" if plan.branches == 1 else f"{plan.branches} branches"


def kinds(lines: list[RoundLine]) -> str:
    """Per mode and kind of round: its share of the mode's time, and what the controller
    expected of such rounds against what they gave (a kind it chose more than it paid shows
    here: e.g. branched rounds on text their first branch accepted whole)."""
    groups: dict[tuple[str, str], list[RoundLine]] = defaultdict(list)
    for line in lines:
        groups[line.mode, kind_of(line)].append(line)
    spent = defaultdict(float)
    for (mode, _), group in groups.items():
        spent[mode] += sum(line.seconds for line in group)
    rows = [
        "| mode | kind | rounds | share of time | mean gamma | tokens a round, expected | "
        "kept | ms a round, expected | measured | tokens/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (mode, kind), group in sorted(groups.items()):
        seconds = sum(line.seconds for line in group)
        priced = [line for line in group if line.plan.round_s > 0]
        expected_tokens = _mean([line.plan.expected_tokens for line in priced])
        # the target alone is priced a token, and decodes several a call
        per_call = [
            line.plan.round_s * 1000 * (line.emitted if kind == "alone" else 1) for line in priced
        ]
        expected_ms = _mean(per_call)
        if kind == "alone":
            expected_tokens = "-"
        rate = sum(line.emitted for line in group) / seconds if seconds > 0 else 0.0
        share = seconds / spent[mode] if spent[mode] > 0 else 0.0
        rows.append(
            f"| {mode} | {kind} | {len(group)} | {share:.0%} | "
            f"{_mean([line.report.gamma for line in group])} | {expected_tokens} | "
            f"{_mean([line.emitted for line in group])} | {expected_ms} | "
            f"{_mean([line.seconds * 1000 for line in group])} | {rate:.1f} |"
        )
    return "\n".join(rows)


def _mean(values: list[float]) -> str:
    return f"{sum(values) / len(values):.2f}" if values else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.daemon.decode.round_log", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("file", help="a round log (the round_log setting's file)")
    args = parser.parse_args(argv)
    try:
        lines = read(args.file)
    except OSError as error:
        print(f"round_log: cannot read {args.file}: {error.strerror}", file=sys.stderr)
        return 1
    print(summary(lines))
    print()
    print(kinds(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

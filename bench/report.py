"""``hetspec bench``'s report: the tables of ``bench.md`` and the records of ``bench.json``.

Contract: every function here reads records and summaries and returns text (a markdown table,
a line), or writes the reports (``write_reports``: ``bench.md`` and ``bench.json`` as far as
measured, so that a run cut short keeps what it measured). Speeds are shown relative to the
fastest target-alone row (``is_target_alone``); a figure that is not known is "-".
"""

from __future__ import annotations

import json
from pathlib import Path

from hetspec.bench.records import Record, same_output, summarise


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def is_target_alone(system: str) -> bool:
    """The rows that decode with the target alone: hetspec's autoregressive mode and the
    peers' target-alone rows (llama-server's)."""
    return system == "autoregressive" or "target alone" in system


def modes_table(records: list[Record]) -> tuple[str, dict, str]:
    """The systems side by side; speed and TTFT relative to the fastest target-alone row."""
    names = list(dict.fromkeys(r.system for r in records))
    summaries = {name: summarise([r for r in records if r.system == name]) for name in names}
    fastest = max(
        (n for n in names if is_target_alone(n)), key=lambda n: summaries[n]["tokens_per_s"]
    )
    base = summaries[fastest]
    sequential = summaries["sequential"]
    alone = [r for r in records if r.system == "autoregressive"]
    for name, summary in summaries.items():
        summary["same_as_alone"] = same_output([r for r in records if r.system == name], alone)
    lines = [
        "| system | decode tokens/s | min-max | x fastest target alone | x sequential | "
        "mean accepted | accepted/drafted | gamma | overlapped rounds | TTFT ms | x TTFT | "
        "efficiency | tokens = alone |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        same = s["same_as_alone"]
        low, high = s["tokens_per_s_range"]
        lines.append(
            f"| {name} | {s['tokens_per_s']:.1f} | {low:.1f}-{high:.1f} | "
            f"{s['tokens_per_s'] / base['tokens_per_s']:.2f} | "
            f"{s['tokens_per_s'] / sequential['tokens_per_s']:.2f} | "
            f"{_fmt(s['mean_accepted'], '.2f')} | {_fmt(s['acceptance'], '.0%')} | "
            f"{_fmt(s['gamma_mean'], '.1f')} | "
            f"{_fmt(s['overlapped'], '.0%')} | {s['ttft_ms']:.2f} | "
            f"{s['ttft_ms'] / base['ttft_ms']:.2f} | "
            f"{_fmt(s['efficiency'], '.2f')} | {f'{same[0]}/{same[1]}' if same else '-'} |"
        )
    lines.append(
        f"\nx fastest target alone, x TTFT: relative to {fastest}; decode tokens/s is the "
        "median over the passes, min-max their range. tokens = alone: requests whose token "
        "ids equal hetspec's target alone (autoregressive) on the same prompt (greedy or "
        "seeded: for hetspec's modes all of them, or the output is not lossless; a peer's may "
        "differ where its arithmetic breaks a near-tie another way, or past an end token, "
        "which llama-server never samples with ignore_eos while hetspec generates past it)."
    )
    return "\n".join(lines), summaries, fastest


def rounds_table(records: list[Record]) -> str:
    """Where a speculative system's round goes, in the daemon's clock: means over its
    requests, each weighed by its rounds ("" when no system drafted)."""
    lines = []
    for name in dict.fromkeys(r.system for r in records):
        drafted = [r for r in records if r.system == name and r.rounds and r.gamma_mean]
        if not drafted:
            continue

        def mean(field: str, of=drafted) -> str:
            known = [(getattr(r, field), r.rounds) for r in of if getattr(r, field) is not None]
            weight = sum(n for _, n in known)
            return _fmt(sum(v * n for v, n in known) / weight if weight else None, ".3f")

        round_ms = sum(r.decode_ms for r in drafted) / sum(r.rounds for r in drafted)
        many, rounds = (
            sum(pair) for pair in zip(*(r.branched_rounds for r in drafted), strict=True)
        )
        branched = _fmt(many / rounds if rounds else None, ".0%")
        lines.append(
            f"| {name} | {round_ms:.3f} | {mean('gamma_mean')} | {branched} | "
            f"{mean('t_draft_ms')} | {mean('t_draft_link_ms')} | {mean('t_verify_ms')} | "
            f"{mean('t_verify_link_ms')} | {mean('t_overhead_ms')} | "
            f"{mean('t_prefill_wait_ms')} |"
        )
    if not lines:
        return ""
    return "\n".join(
        [
            "| system | round ms | gamma | branched rounds | draft ms a token | "
            "draft call's link ms | verify ms (daemon-seen) | of which link ms | "
            "daemon's own ms a round | drafter's prefill wait ms a round |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *lines,
            "\nBranched rounds: of the drafted rounds, those of more than one branch (a GPU "
            "verifier's fixed-width forward gathers a path for each, where a chain attends in "
            "place). A link: a call's time as the daemon sees it beyond the worker's own "
            "(messages, wake-ups, the worker's Python around its compute). The daemon's own: "
            "a round's period (from the previous round's report to its own) beyond its draft "
            "and verify calls (verdict, bookkeeping, the controller, streaming the tokens out, "
            "where a draft sent early does not overlap them). The "
            "drafter's prefill wait: a first draft's wait for the drafter's prompt prefill, which "
            "starts with that draft where the request began decoding alone. Round ms, the daemon's "
            "own and the wait: over every round, rounds of the target alone included.",
        ]
    )


def load_table(records: list[Record]) -> tuple[str, dict]:
    names = list(dict.fromkeys(r.system for r in records))
    rows = {}
    for name in names:
        mine = [r for r in records if r.system == name]
        rows[name] = {
            "before": summarise([r for r in mine if not r.loaded])["tokens_per_s"],
            "after": summarise([r for r in mine if r.loaded])["tokens_per_s"],
            "whole": sum(r.decoded for r in mine) / sum(r.decode_ms for r in mine) * 1000,
        }
    fixed = {n: v for n, v in rows.items() if n != "adaptive"}
    best = max(fixed, key=lambda n: fixed[n]["whole"])
    lines = [
        "| system | tokens/s before load | after | whole run | x best fixed |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        share = row["whole"] / rows[best]["whole"]
        lines.append(
            f"| {name} | {row['before']:.1f} | {row['after']:.1f} | {row['whole']:.1f} | "
            f"{share:.3f} |"
        )
    return "\n".join(lines), {"rows": rows, "best_fixed": best}


def llama_server_settings(info: dict) -> str:
    """What the peers' process chose for llama-server and why (its measured decode tokens/s),
    one line of the report; empty without llama-server."""
    parts = []
    flash = info.get("flash_attention") or {}
    if flash.get("chosen"):
        speeds = ", ".join(f"{k} {v}" for k, v in flash.items() if k != "chosen")
        parts.append(
            f"flash attention {flash['chosen']} (decode tokens/s of the target alone "
            f"after a long prompt: {speeds})"
        )
    for key, speeds in info.items():
        if not (isinstance(speeds, dict) and speeds):
            continue
        listed = ", ".join(f"{n} {v}" for n, v in speeds.items())
        if key.startswith("sweep_p_min"):
            suffix = key.removeprefix("sweep_p_min")
            best = max(speeds, key=speeds.__getitem__)
            parts.append(
                f"minimum draft probability {best}{suffix} at that length (decode "
                f"tokens/s by p-min: {listed})"
            )
        elif key.startswith("sweep"):
            suffix = key.removeprefix("sweep")  # "" or " (draft on GPU)", ...
            best = info.get(f"best_n_max{suffix}")
            parts.append(f"draft length {best}{suffix} (decode tokens/s by n-max: {listed})")
    return f"llama-server's settings, measured: {'; '.join(parts)}.\n" if parts else ""


def progress_line(summary: dict[str, dict], fastest: str) -> str:
    """The default mode's and the fastest row's speed over the fastest target alone: the
    tables themselves are printed once, at the end."""

    def ratio(name: str) -> float:
        return summary[name]["tokens_per_s"] / summary[fastest]["tokens_per_s"]

    best = max(summary, key=ratio)
    head = f"adaptive {ratio('adaptive'):.2f}x, " if "adaptive" in summary else ""
    return f"{head}fastest {best} {ratio(best):.2f}x the fastest target alone ({fastest})"


def sweep_table(sweep: list[dict]) -> str:
    """Each system's speed over the fastest target-alone row, one column per target."""
    columns = [f"{row['target']} {row['placement']} (c={row['c']:.1f})" for row in sweep]
    systems = list(dict.fromkeys(name for row in sweep for name in row["summary"]))
    lines = ["| system | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for system in systems:
        cells = []
        for row in sweep:
            mine, base = row["summary"].get(system), row["summary"][row["fastest_alone"]]
            cells.append(f"{mine['tokens_per_s'] / base['tokens_per_s']:.2f}" if mine else "-")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_so_far(
    records: list[Record], *, out: Path, report: list[str], results: dict, heading: str, total: int
) -> None:
    """The reports with the modes measured so far under ``heading``: a run cut short (a
    device call's time limit) keeps the prompts it finished."""
    done = len({(r.prompt, r.repeat) for r in records})
    table = modes_table(records)[0]
    note = f"{heading}, so far: {done} of {total} requests a system\n"
    write_reports(out, [*report, note, table, ""], results)


def write_reports(out: Path, report: list[str], results: dict) -> None:
    """bench.md and bench.json as far as measured."""
    (out / "bench.md").write_text("\n".join(report) + "\n")
    document = {
        placement: {
            "summary": r["summary"],
            "load": r.get("load"),
            "records": [vars(x) for x in r["records"]],
            "load_records": [vars(x) for x in r["load_records"]],
        }
        for placement, r in results.items()
    }
    (out / "bench.json").write_text(json.dumps(document, indent=1))

"""``hetspec bench``'s plots, where matplotlib is installed (the bench extra).

Contract: ``plot`` draws ``bench.png`` (per placement: decode speed by system, adaptive gamma
round by round, acceptance by draft position), ``plot_sweep`` ``bench-sweep.png`` (speedup
against the cost ratio c); each returns whether it wrote its file (False without matplotlib,
or with nothing to draw).
"""

from __future__ import annotations

from pathlib import Path

from hetspec.bench.records import Record


def plot(path: Path, results: dict) -> bool:
    try:
        import matplotlib  # noqa: PLC0415 - optional (bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    placements = list(results)
    if not placements:  # every target was skipped
        return False
    figure, axes = plt.subplots(
        len(placements), 3, figsize=(18, 4 * len(placements)), squeeze=False
    )
    for row, placement in enumerate(placements):
        summaries = results[placement]["summary"]
        names = list(summaries)
        bars = axes[row][0].barh(names, [summaries[n]["tokens_per_s"] for n in names])
        axes[row][0].bar_label(bars, fmt="%.1f", padding=2, fontsize="small")
        axes[row][0].margins(x=0.15)  # room for the labels
        axes[row][0].invert_yaxis()  # the table's order, top to bottom
        axes[row][0].set_xlabel("decode tokens/s")
        axes[row][0].set_title(f"{placement}: decoding modes")
        _plot_gamma(axes[row][1], placement, results[placement])
        _plot_acceptance(axes[row][2], placement, results[placement]["records"])
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def _plot_gamma(axis, placement: str, result: dict) -> None:
    """Adaptive gamma round by round: across the load phase when there was one."""
    loaded = [r for r in result["load_records"] if r.system == "adaptive"]
    records = loaded or [r for r in result["records"] if r.system == "adaptive"]
    axis.plot([g for r in records for g in r.gammas])
    if loaded:
        switch = sum(len(r.gammas) for r in loaded if not r.loaded)
        axis.axvline(switch, color="red", linestyle="--", label="load starts")
        axis.legend()
    axis.set_xlabel("round")
    axis.set_ylabel("gamma")
    what = "load on the drafter's core" if loaded else "over the prompt set"
    axis.set_title(f"{placement}: adaptive gamma, {what}")


def _plot_acceptance(axis, placement: str, records: list[Record]) -> None:
    """P(the first d drafted tokens are accepted | d tokens drafted) for d = 1..8, per
    speculative system; a position no round of a system drafted is not drawn (not a zero)."""
    depths = range(1, 9)
    for system in dict.fromkeys(r.system for r in records if r.rounds):
        mine = [r for r in records if r.system == system]
        reach = []
        for d in depths:
            drafted = sum(g >= d for r in mine for g in r.gammas)
            accepted = sum(r.by_depth[d - 1] for r in mine if len(r.by_depth) >= d)
            reach.append(accepted / drafted if drafted else float("nan"))
        axis.plot(list(depths), reach, marker="o", label=system)
    axis.set_xlabel("draft position")
    axis.set_ylabel("share of rounds drafting that far accepted up to it")
    axis.set_ylim(0, 1)
    axis.set_title(f"{placement}: acceptance by position")
    axis.legend(fontsize="small")


def plot_sweep(path: Path, sweep: list[dict]) -> bool:
    """Speedup over the fastest target-alone row against c, one line per system."""
    try:
        import matplotlib  # noqa: PLC0415 - optional (bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(9, 6))
    placements = list(dict.fromkeys(row["placement"] for row in sweep))
    for placement in placements:
        rows = sorted((r for r in sweep if r["placement"] == placement), key=lambda r: r["c"])
        systems = list(dict.fromkeys(name for row in rows for name in row["summary"]))
        for system in systems:
            points = [
                (
                    row["c"],
                    row["summary"][system]["tokens_per_s"]
                    / row["summary"][row["fastest_alone"]]["tokens_per_s"],
                )
                for row in rows
                if system in row["summary"]
            ]
            label = system if len(placements) == 1 else f"{system} ({placement})"
            axis.plot(*zip(*points, strict=True), marker="o", label=label)
    axis.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axis.set_xscale("log")
    axis.set_xlabel("c = T_target / T_draft (llama.cpp, one token)")
    axis.set_ylabel("decode speed / the fastest target-alone row")
    axis.set_title("Speedup against the cost ratio of the pair")
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True

"""Which verifier the full GPU call should bench, from the quick call's tables.

    python native/gpu-pick-settings.py OUT_DIR > SETTINGS
    python native/gpu-pick-settings.py --tiling OUT_DIR [TABLE] > FIELDS
    python native/gpu-pick-settings.py --compiled-matmul OUT_DIR [TABLE] > MATMUL

Reads OUT_DIR/verify-1b-fixed16{,-triton,-compiled,-split,-compiled-split}.json (bench_verify
--json) and prints the daemon settings (space-separated, gpu-checks.sh's BENCH_SET) of the fastest
width-invariant verifier among those whose every invariance row, the tree's included, is
bit-identical, as each table describes its verifier (compiled, its matmul and tiling, its
attention; an int8 table computes another model's logits and is passed over). Fastest: the
least T(1) (a token of the target alone) plus the slowest 16-row forward among the table's
shapes (a round's verification, a chain's or a tree's). Nothing (cuBLAS, eager, gathered
paths: the default) when no alternative qualifies.

Where OUT_DIR also holds roundtrip-spin100.json and roundtrip-spin2000.json (bench_roundtrip
--json: a worker woken for every call, and one polling through the gap), it adds
``worker_spin_us=2000`` when polling saves at least ``SPIN_PAYS_US`` a call; and where it holds
roundtrip-hold.json and roundtrip-hold-daemon.json (the worker computing 1 ms an answer, the
daemon sleeping through it or polling), ``daemon_spin_us=5000`` when polling saves as much.

With --tiling it reads OUT_DIR/TABLE (default matmul.json; bench_matmul --json) instead and
prints the Triton kernel's fastest tiling over a forward of 16 rows (a fixed-width verifier's) among
those that kept every row's bits, as bench_verify's --matmul-tiling takes it
(``block_n=32,warps=8``; nothing: the default). With --compiled-matmul it prints the matmul a
verifier compiled with torch.compile should run there: ``triton`` where that tiling's 16-row
forward beats cuBLAS's, else ``torch``. The reasoning goes to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CANDIDATES = (
    "verify-1b-fixed16.json",
    "verify-1b-fixed16-triton.json",
    "verify-1b-fixed16-compiled.json",
    "verify-1b-fixed16-split.json",
    "verify-1b-fixed16-compiled-split.json",
)


def settings_of(name: str, table: dict) -> str:
    """The daemon settings that run the verifier table ``name`` describes (a table from
    before bench_verify recorded ``compile`` says so by its name)."""
    settings = []
    if table.get("compile", "compiled" in name):
        settings.append("gpu_worker.compile=true")
    if table.get("matmul") == "triton":
        settings.append('gpu_worker.matmul="triton"')
        if tiling := table.get("matmul_tiling"):  # TOML's inline table, without spaces
            fields = ",".join(f"{field}={value}" for field, value in tiling.items())
            settings.append(f"gpu_worker.matmul_tiling={{{fields}}}")
    if table.get("attention") == "split":
        settings.append('gpu_worker.attention="split"')
    return " ".join(settings)


# a round makes two calls: 2 x 25 us is ~1.5% of the third session's ~3.5 ms rounds
SPIN_PAYS_US = 25.0
SPINS = (100, 2000)  # the worker's poll before it sleeps: the default, and through a gap
LINK = "mailboxes, message frames"  # a command's path: the daemon's default link, no arena row


DAEMON_SPIN = 5000  # the daemon's poll after a call: longer than a round's calls


def saved_us(folder: Path, sleeping: str, polling: str) -> float | None:
    """How much less a call takes in table ``polling`` than in ``sleeping`` (bench_roundtrip
    --json, the link's median); None where either is missing."""
    medians = []
    for name in (sleeping, polling):
        try:
            medians.append(float(json.loads((folder / name).read_text())["median_us"][LINK]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            print(f"{name}: not read ({error!r})", file=sys.stderr)
            return None
    return medians[0] - medians[1]


def spin_setting(folder: Path) -> str:
    """``worker_spin_us=2000`` where the round-trip tables say polling through a call's gap
    saves at least ``SPIN_PAYS_US`` a call; else nothing."""
    saved = saved_us(folder, f"roundtrip-spin{SPINS[0]}.json", f"roundtrip-spin{SPINS[1]}.json")
    if saved is None:
        return ""
    print(f"a call polling {SPINS[1]} us against {SPINS[0]}: {saved:.1f} us saved", file=sys.stderr)
    return f"worker_spin_us={SPINS[1]}" if saved >= SPIN_PAYS_US else ""


def daemon_spin_setting(folder: Path) -> str:
    """``daemon_spin_us=5000`` where the daemon reading its replies by polling instead of
    sleeping through a 1 ms call saves at least ``SPIN_PAYS_US`` a call; else nothing."""
    saved = saved_us(folder, "roundtrip-hold.json", "roundtrip-hold-daemon.json")
    if saved is None:
        return ""
    print(
        f"the daemon polling through a 1 ms call against sleeping: {saved:.1f} us saved",
        file=sys.stderr,
    )
    return f"daemon_spin_us={DAEMON_SPIN}" if saved >= SPIN_PAYS_US else ""


def t1_ms(table: dict) -> float | None:
    rows = [r["median_ms"] for r in table.get("rows", []) if r["width"] == 1]
    return min(rows) if rows else None


def price_ms(table: dict) -> float | None:
    """T(1) plus the slowest forward of 16 rows (of any shape; none timed: T(1) alone)."""
    t1 = t1_ms(table)
    wide = [r["median_ms"] for r in table.get("rows", []) if r["width"] == 16]
    return None if t1 is None else t1 + max(wide, default=0.0)


def fastest_tiling(document: dict, rows: int = 16) -> str:
    """The fastest tiling's changed fields at ``rows`` rows, among the invariant ones."""
    best = best_tiling(document, rows)
    return best[1] if best else ""


def compiled_matmul(document: dict, rows: int = 16) -> str:
    """The matmul a compiled verifier should run: "triton" where the fastest invariant
    tiling's forward of ``rows`` rows beats cuBLAS's in bench_matmul's table, else "torch"."""
    best = best_tiling(document, rows)
    cublas = document["forward_us"].get(f"cuBLAS rows {rows}")
    print(f"cuBLAS: {cublas} us a forward", file=sys.stderr)
    if best is None or cublas is None or best[0] >= cublas:
        return "torch"
    return "triton"


def best_tiling(document: dict, rows: int) -> tuple[float, str] | None:
    """(us a forward, changed fields) of the fastest tiling at ``rows`` rows among the
    invariant ones; None: none qualifies."""
    broken = {
        label.removesuffix(" invariant")
        for row in document["rows"]
        for label, kept in row.items()
        if label.endswith(" invariant") and not kept
    }
    best: tuple[float, str] | None = None
    for label, fields in document["tilings"].items():
        us = document["forward_us"].get(f"{label} rows {rows}")
        print(
            f"tiling {label}: {us} us a forward{', rows changed' if label in broken else ''}",
            file=sys.stderr,
        )
        if us is None or label in broken:
            continue
        text = ",".join(f"{field}={value}" for field, value in fields.items())
        if best is None or us < best[0] or (us == best[0] and not text):
            best = (us, text)
    if best is not None:
        print(f"chosen tiling: {best[1] or 'the default'} ({best[0]} us)", file=sys.stderr)
    return best


def main() -> int:
    matmul_table = sys.argv[1:2] in (["--tiling"], ["--compiled-matmul"])  # bench_matmul's
    low, high = (3, 4) if matmul_table else (2, 2)
    if not low <= len(sys.argv) <= high or sys.argv[1] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2
    if matmul_table:
        name = sys.argv[3] if len(sys.argv) == 4 else "matmul.json"
        try:
            document = json.loads((Path(sys.argv[2]) / name).read_text())
        except (OSError, ValueError) as error:
            print(f"{name}: not read ({error}): the default", file=sys.stderr)
            print("" if sys.argv[1] == "--tiling" else "torch")
            return 0
        choose = fastest_tiling if sys.argv[1] == "--tiling" else compiled_matmul
        print(choose(document))
        return 0
    folder = Path(sys.argv[1])
    best: tuple[float, str] | None = None
    for name in CANDIDATES:
        try:
            table = json.loads((folder / name).read_text())
        except (OSError, ValueError) as error:
            print(f"{name}: not read ({error})", file=sys.stderr)
            continue
        price = price_ms(table)
        invariance = table.get("invariance", [])
        differing = sum(r["rows_differ"] for r in invariance)
        print(
            f"{name}: T(1) {t1_ms(table)} ms, T(1) + T(16) {price} ms, {differing} differing "
            f"rows in {len(invariance)} checks",
            file=sys.stderr,
        )
        if table.get("matmul_refused"):  # its rows are cuBLAS's: the Triton kernel refused
            print(f"{name}: the Triton kernel refused ({table['matmul_refused']})", file=sys.stderr)
            continue
        if table.get("weights") == "int8":  # another model's text: never the bf16 target's
            print(f"{name}: int8 weights, passed over", file=sys.stderr)
            continue
        if price is None or not invariance or differing:
            continue
        chosen = settings_of(name, table)
        if best is None or price < best[0]:
            best = (price, chosen)
    if best is not None:
        print(f"chosen: {best[1] or 'the default'} ({best[0]} ms)", file=sys.stderr)
    settings = [best[1] if best else "", spin_setting(folder), daemon_spin_setting(folder)]
    print(" ".join(setting for setting in settings if setting))
    return 0


if __name__ == "__main__":
    sys.exit(main())

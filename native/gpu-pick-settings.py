"""Which verifier the full GPU call should bench, from the quick call's T_verify tables.

    python native/gpu-pick-settings.py OUT_DIR > SETTINGS

Reads OUT_DIR/verify-1b-fixed16{,-triton,-compiled}.json (bench_verify --json) and prints the
daemon settings (space-separated, gpu-checks.sh's BENCH_SET) of the fastest width-invariant
verifier: the lowest T(1) among those whose every invariance row, the tree's included, is
bit-identical. Nothing (cuBLAS, eager, the default) when neither alternative qualifies. The
reasoning goes to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CANDIDATES = {  # table -> the daemon setting that runs it
    "verify-1b-fixed16.json": "",
    "verify-1b-fixed16-triton.json": 'gpu_worker.matmul="triton"',
    "verify-1b-fixed16-compiled.json": "gpu_worker.compile=true",
}


def t1_ms(table: dict) -> float | None:
    rows = [r["median_ms"] for r in table.get("rows", []) if r["width"] == 1]
    return min(rows) if rows else None


def main() -> int:
    folder = Path(sys.argv[1])
    best: tuple[float, str] | None = None
    for name, setting in CANDIDATES.items():
        try:
            table = json.loads((folder / name).read_text())
        except (OSError, ValueError) as error:
            print(f"{name}: not read ({error})", file=sys.stderr)
            continue
        t1 = t1_ms(table)
        invariance = table.get("invariance", [])
        differing = sum(r["rows_differ"] for r in invariance)
        print(f"{name}: T(1) {t1} ms, {differing} differing rows in {len(invariance)} checks",
              file=sys.stderr)  # fmt: skip
        if t1 is None or not invariance or differing:
            continue
        if best is None or t1 < best[0]:
            best = (t1, setting)
    if best is not None:
        print(f"chosen: {best[1] or 'the default'} ({best[0]} ms)", file=sys.stderr)
        print(best[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""ARCA's profiler on the bundled pair and the HCMP bench at a tiny size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetspec.bench import hcmp as bench
from hetspec.workers.runtimes.torch_runtime import TorchRuntime
from hetspec.workers.runtimes.torch_runtime.hcmp_profiler import (
    SHAPES,
    emitted_per_round,
    verify_costs,
)
from hetspec.workers.runtimes.torch_runtime.hcmp_runtime import HcmpRuntime
from hetspec.workers.runtimes.torch_runtime.hcmp_sides import HcmpSettings, Side

MODELS = Path(__file__).resolve().parents[1] / "models"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_profiler_times_every_width_and_ratio_and_calibrates_acceptance() -> None:
    side = Side("cpu", threads=1)
    target = HcmpRuntime(MODELS / "target", HcmpSettings(0.5, gpu=side, cpu=side), max_context=128)
    prefix = list(range(5, 37))
    costs = verify_costs(target, prefix, [1, 4], [0.0, 0.5, 1.0], repeats=1)
    assert set(costs) == {(w, r) for w in (1, 4) for r in (0.0, 0.5, 1.0)}
    assert all(ms > 0 for ms in costs.values())
    assert target.settings.ratio == 0.5  # given back as it was
    draft = TorchRuntime(MODELS / "draft", device="cpu", dtype="float32", max_context=128)
    emitted = emitted_per_round(target, draft, [prefix[:8]], [1, 4], tokens=8)
    assert set(emitted) == {(w, s.name) for w in (1, 4) for s in SHAPES}
    for (width, _), tokens in emitted.items():
        assert 1.0 <= tokens <= width + 1


def test_the_bench_reports_the_profile_the_choice_and_the_boards(tmp_path, capsys) -> None:
    out = tmp_path / "hcmp.md"
    argv = ["--widths", "1,2", "--ratios", "0,0.5,1", "--repeats", "1", "--prefix", "24"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert "identical to the unsplit runtime's: True" in text
    assert text.count("ARCA's choice: width") == 5  # this box, and two boards for two targets each
    assert "Jetson Xavier NX" in text
    assert "Jetson Orin NX" in text

"""HCMP in the serving path: the torch worker loads its verifier split as
``TorchSettings.split_ratio`` says (a ratio, or ARCA's per width measured at load and cached),
refuses in one line what cannot run here and verifies unsplit, and the daemon serves a split
verifier losslessly, showing the split in /props."""

from __future__ import annotations

import json
import platform

import pytest
import torch
from test_daemon import request
from test_hcmp import TARGET
from test_lossless import BundledDaemon

from hetspec.daemon.cli import split_summary
from hetspec.daemon.config import load_config
from hetspec.protocol import worker_messages as m
from hetspec.speculative.control.arca import cache_path, describe_cached
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.workers.runtimes.loading import load_runtime
from hetspec.workers.runtimes.torch_runtime import TorchRuntime
from hetspec.workers.runtimes.torch_runtime.hcmp_choice import ARCA_WIDTHS
from hetspec.workers.runtimes.torch_runtime.hcmp_runtime import HcmpRuntime

TOKENS = [11, 42, 7, 300, 12, 5, 99, 3]


def settings(**fields) -> m.TorchSettings:
    return m.TorchSettings(device="cpu", dtype="float32", max_context=128, threads=1, **fields)


def greedy(runtime, count: int = 12) -> list[int]:
    runtime.prefill(TOKENS)
    return list(runtime.decode(count, SamplingParams(), DrawnSampler(0)))


@pytest.fixture(scope="module")
def unsplit_tokens() -> list[int]:
    return greedy(TorchRuntime(TARGET, device="cpu", dtype="float32", max_context=128, threads=1))


def test_a_configured_split_is_loaded_as_the_worker_loads_it(unsplit_tokens) -> None:
    runtime, words = load_runtime("torch", str(TARGET), settings(split_ratio=0.5))
    assert isinstance(runtime, HcmpRuntime)
    assert runtime.splits
    assert words == "cpu (HCMP split, GPU share 0.5)"
    assert greedy(runtime) == unsplit_tokens


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"split_ratio": 1.5}, "HCMP refused: HCMP split ratio 1.5 is outside [0, 1]; unsplit"),
        ({"split_ratio": -0.25}, "HCMP refused: HCMP split ratio -0.25 is outside [0, 1]; unsplit"),
        (
            {"split_ratio": 0.5, "device": "auto"},
            "HCMP refused: HCMP asked for a GPU share of 0.5 but this box has no CUDA device; "
            "unsplit",
        ),
        (
            {"split_ratio": "auto", "device": "auto"},
            "HCMP auto: this box has no CUDA device to split with; unsplit",
        ),
    ],
)
def test_a_split_that_cannot_run_here_is_one_line_and_the_verifier_runs_unsplit(
    fields, why, unsplit_tokens
) -> None:
    if fields.get("device") == "auto" and torch.cuda.is_available():
        pytest.skip("this box has CUDA: the GPU share can run")
    base = {"device": "cpu", "dtype": "float32", "max_context": 128, "threads": 1} | fields
    runtime, words = load_runtime("torch", str(TARGET), m.TorchSettings(**base))
    assert type(runtime) is TorchRuntime
    assert words == f"cpu ({why})"
    assert greedy(runtime) == unsplit_tokens


def test_arca_measures_each_widths_ratio_at_load_and_reads_it_back(
    tmp_path, unsplit_tokens
) -> None:
    """Both sides this CPU: the split only adds its overhead, and ARCA's measured choice is
    the unsplit ratio nearly everywhere; whatever it chose, the tokens are the target's."""
    auto = settings(split_ratio="auto", split_cache=str(tmp_path))
    runtime, words = load_runtime("torch", str(TARGET), auto)
    assert isinstance(runtime, HcmpRuntime)
    assert words.startswith("cpu (HCMP by ARCA (measured ")
    for width in ARCA_WIDTHS:
        assert f"width {width} ratio " in words
    saved = json.loads(cache_path(tmp_path, TARGET, "cpu").read_text())
    tried = {(w, r) for w, r, _ in saved["cost_ms"]}
    assert {(w, r) for w in ARCA_WIDTHS for r in (0.0, 1.0)} <= tried  # unsplit at every width
    chosen = {w: runtime.ratio_for(w) for w in ARCA_WIDTHS}
    for width, ratio in chosen.items():  # each width's cheapest measured ratio
        mine = {r: ms for w, r, ms in saved["cost_ms"] if w == width}
        assert mine[ratio] == min(mine.values())
    assert greedy(runtime) == unsplit_tokens

    shown = describe_cached(cache_path(tmp_path, TARGET, "cpu"))  # hetspecd --check's line
    assert shown.startswith(f"ARCA profile (measured on {platform.machine()} | ")
    assert ", ".join(f"width {w} ratio {r:g}" for w, r in chosen.items()) in shown

    again, words = load_runtime("torch", str(TARGET), auto)
    assert words.startswith("cpu (HCMP by ARCA (cached profile): ")
    assert {w: again.ratio_for(w) for w in ARCA_WIDTHS} == chosen


def test_a_profile_made_on_another_box_is_refused_in_one_line(tmp_path, unsplit_tokens) -> None:
    auto = settings(split_ratio="auto", split_cache=str(tmp_path))
    load_runtime("torch", str(TARGET), auto)
    path = cache_path(tmp_path, TARGET, "cpu")
    record = json.loads(path.read_text())
    record["box"] = "aarch64 | another CPU x8 | gpu: none"
    path.write_text(json.dumps(record))
    runtime, words = load_runtime("torch", str(TARGET), auto)
    assert type(runtime) is TorchRuntime
    assert "profile made for box 'aarch64 | another CPU x8 | gpu: none'" in words
    assert words.endswith("; unsplit (delete the file to measure again))")
    assert "\n" not in words
    assert greedy(runtime) == unsplit_tokens


@pytest.mark.process
def test_the_daemon_serves_a_split_verifier_losslessly_and_says_so(tmp_path) -> None:
    daemon = BundledDaemon(
        tmp_path,
        "draft-cpu",
        "--set",
        'gpu_worker.device="cpu"',
        "--set",
        "gpu_worker.split_ratio=0.5",
    )
    try:
        status, props = request(daemon.socket, "GET", "/props")
        assert status == 200
        assert "HCMP split, GPU share 0.5" in json.dumps(props)
        prompt = "def read_lines(path):\n"
        alone = daemon.generate(prompt, mode="autoregressive", max_tokens=24, ignore_eos=True)
        for mode in ("sequential", "adaptive"):
            out = daemon.generate(prompt, mode=mode, max_tokens=24, ignore_eos=True)
            assert out["tokens"] == alone["tokens"], mode
    finally:
        daemon.stop()


def test_check_says_what_the_split_will_do(tmp_path) -> None:
    """``hetspecd --check``'s line: a ratio, ARCA's cached choice, or why it is ignored."""

    def config(**overrides):
        return load_config(environ={}, overrides={"cache_dir": str(tmp_path), **overrides})

    auto = {"gpu_runtime": "torch", "gpu_worker.split_ratio": "auto"}
    assert split_summary(config(**auto)) == (
        "HCMP auto: no ARCA profile yet: the GPU worker measures one at its first start"
    )
    folder = config(**auto).target.folder
    load_runtime("torch", folder, settings(split_ratio="auto", split_cache=str(tmp_path)))
    shown = split_summary(config(**auto, **{"gpu_worker.device": "cpu"}))
    assert shown.startswith("HCMP auto: ARCA profile (measured on ")
    fixed = {"gpu_runtime": "torch", "gpu_worker.split_ratio": 0.5}
    assert split_summary(config(**fixed)).startswith("HCMP split, GPU share 0.5")
    drafting = config(**fixed, placement="draft-gpu")
    assert split_summary(drafting) == "split_ratio 0.5: ignored, the GPU worker drafts in draft-gpu"

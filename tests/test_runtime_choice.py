"""gpu_runtime = "auto": each runtime measured here, the fastest chosen, the figures cached."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from test_daemon import request
from test_lossless import BundledDaemon

from hetspec.daemon.config import BUNDLED_MODELS, ConfigError, cache_dir, load_config
from hetspec.daemon.load.runtime_trials import (
    CUDA_VERIFY_WIDTHS,
    VERIFY_WIDTHS,
    CpuClock,
    decide_drafter,
    decide_gpu_runtime,
    measure,
    profile_key,
)
from hetspec.daemon.supervision.supervisor import worker_specs
from hetspec.protocol import ProbeFailure, RuntimeProfile, decode_profile
from hetspec.speculative.control.runtime_choice import (
    MODEL_FREE_ACCEPTANCE,
    Rate,
    best_rate,
    expected_tokens,
    fastest,
    fastest_drafter,
    fewest_fast_threads,
    thread_counts,
)

TARGET_GGUF = BUNDLED_MODELS / "target" / "target-q8_0.gguf"


def test_expected_tokens_counts_the_accepted_run_and_the_verifiers_own() -> None:
    assert expected_tokens(0, 0.7) == 1
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(4, 1.0) == 5


def test_best_rate_drafts_only_where_a_wide_verification_pays() -> None:
    cheap_width = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}  # a GPU: width is nearly free
    dear_width = {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}  # width costs as much as tokens
    assert best_rate(cheap_width, None) == Rate(100.0, 0)  # no drafter: the target alone
    assert best_rate(cheap_width, draft_ms=0.5).gamma == 7
    assert best_rate(cheap_width, draft_ms=0.5).tokens_per_s > 100.0
    assert best_rate(dear_width, draft_ms=0.5) == Rate(100.0, 0)
    with pytest.raises(ValueError, match="width 1"):
        best_rate({2: 1.0}, None)


def test_without_a_draft_model_the_verifier_flat_in_width_wins_a_near_tie_alone() -> None:
    """The profiles measured here for SmolLM2-135M (ms): llama.cpp decodes alone 2% faster,
    but drafts from the text itself (free, accepted at MODEL_FREE_ACCEPTANCE) pay only on
    the native kernels, whose cost barely grows with width."""
    llama = {1: 9.39, 2: 16.79, 4: 26.16, 8: 43.64, 16: 80.11}
    native = {1: 9.58, 2: 12.20, 4: 18.40, 8: 18.11, 16: 25.44}
    alone = {name: best_rate(p, None) for name, p in (("llama.cpp", llama), ("native", native))}
    assert fastest(alone) == "llama.cpp"
    free = {
        name: best_rate(p, 0.0, MODEL_FREE_ACCEPTANCE)
        for name, p in (("llama.cpp", llama), ("native", native))
    }
    assert fastest(free) == "native"
    assert free["llama.cpp"].gamma == 0 < free["native"].gamma


def test_the_fastest_runtime_wins_and_a_tie_keeps_the_first() -> None:
    assert fastest({"torch": Rate(50.0, 0), "llama.cpp": Rate(80.0, 3)}) == "llama.cpp"
    assert fastest({"llama.cpp": Rate(50.0, 0), "torch": Rate(50.0, 2)}) == "llama.cpp"
    with pytest.raises(ValueError, match="no runtime"):
        fastest({})


def profile(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetspec.workers.tools.profile", *argv],
        capture_output=True,
        timeout=180,
        check=False,
    )


@pytest.mark.process
def test_a_profile_times_each_width_in_a_process_of_its_own() -> None:
    result = profile("llama.cpp", str(TARGET_GGUF), "--widths", "1,4", "--repeats", "3")
    assert result.returncode == 0, result.stderr
    report = decode_profile(result.stdout)
    assert isinstance(report, RuntimeProfile)
    assert (report.runtime, report.device, report.widths) == ("llama.cpp", "cpu", [1, 4])
    assert all(ms > 0 for ms in report.median_ms)
    assert report.prefix == 128


@pytest.mark.process
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_verifier_that_borrows_the_drafter_s_cores_is_profiled_on_them() -> None:
    """Plain rounds verify, and the target decodes alone, on the drafter's cores too: the
    profile the controller prices them by is taken so, and cached apart."""
    own, spare = sorted(os.sched_getaffinity(0))[:2]
    result = profile(
        "native",
        str(TARGET_GGUF),
        "--widths",
        "1,4",
        "--repeats",
        "3",
        "--cores",
        str(own),
        "--spare-cores",
        str(spare),
    )
    assert result.returncode == 0, result.stderr
    report = decode_profile(result.stdout)
    assert isinstance(report, RuntimeProfile)
    assert (report.cores, report.spare_cores) == ([own], [spare])
    config = load_config(environ={"HETSPEC_GPU_WORKER__DEVICE": "cpu"})
    verifier = worker_specs(config, "json", gpu_runtime="native")["gpu"]
    assert verifier.spare_cores  # a 2-core box: the draft's core is lent
    alone = dataclasses.replace(verifier, spare_cores=())
    assert profile_key(verifier, [1, 8]) != profile_key(alone, [1, 8])


@pytest.mark.process
def test_a_model_that_cannot_load_is_a_failure_report_not_a_traceback(tmp_path) -> None:
    result = profile("torch", str(tmp_path / "nowhere"))
    assert result.returncode == 0
    report = decode_profile(result.stdout)
    assert isinstance(report, ProbeFailure)
    assert "nowhere" in report.message
    assert b"Traceback" not in result.stderr


def test_the_cache_dir_follows_the_environment() -> None:
    assert cache_dir("/x", {"XDG_CACHE_HOME": "/y"}) == Path("/x")
    assert cache_dir(None, {"XDG_CACHE_HOME": "/y"}) == Path("/y/hetspec")
    assert cache_dir(None, {"HOME": "/home/z"}).name == "hetspec"
    # as the model builders': the tests' daemons keep their profiles out of the user's cache
    both = {"HETSPEC_CACHE_DIR": "/h", "XDG_CACHE_HOME": "/y"}
    assert cache_dir(None, both) == Path("/h")
    assert cache_dir("/x", both) == Path("/x")


@pytest.mark.process
def test_auto_measures_every_runtime_chooses_the_fastest_and_reuses_the_figures(tmp_path) -> None:
    config = load_config(environ={"HETSPEC_GPU_WORKER__DEVICE": "cpu"})
    assert config.gpu_runtime == "auto"  # the default
    decision = asyncio.run(decide_gpu_runtime(config, cache=tmp_path))
    assert decision.chosen_by == "measurement"
    assert decision.role == "verifier"  # draft-cpu: the GPU worker holds the target
    assert {p.runtime for p in decision.profiles} == {"llama.cpp", "native", "torch"}
    assert not decision.failures
    assert decision.draft_ms is not None
    assert decision.draft_ms > 0
    assert decision.runtime == max(decision.rates, key=decision.rates.get)
    assert decision.runtime in decision.summary()
    assert not decision.cached
    # the chosen verifier's figures are what the controllers start from
    chosen = next(p for p in decision.profiles if p.runtime == decision.runtime)
    costs = decision.verifier_costs_s()
    assert costs is not None
    assert costs[1] == chosen.median_ms[0] / 1000
    assert sorted(costs) == chosen.widths
    # up to the widest tree a slot holds: wide trees priced by measurement, not extrapolation
    assert max(chosen.widths) >= config.max_tree_nodes

    again = asyncio.run(decide_gpu_runtime(config, cache=tmp_path))
    assert again.cached
    assert again.profiles == decision.profiles
    assert again.runtime == decision.runtime


def test_other_processes_busy_time_is_the_box_s_less_our_own() -> None:
    before = CpuClock(wall_s=10.0, box_busy_s=100.0, ours_s=5.0)
    after = CpuClock(wall_s=12.0, box_busy_s=104.0, ours_s=7.5)  # we used 2.5 s of 4
    assert after.others_cores_since(before) == pytest.approx(0.75)
    assert CpuClock(12.0, None, 7.5).others_cores_since(before) is None  # no /proc/stat
    assert CpuClock(12.0, 101.0, 7.5).others_cores_since(before) == 0.0  # rounding: never < 0
    assert CpuClock.now().wall_s > 0


@pytest.mark.process
def test_a_runtime_timed_beside_a_busy_process_is_not_cached(tmp_path) -> None:
    """Its figures are that moment's: the next start measures again (four daemons started
    at once once cached the wrong runtime for good)."""
    config = load_config(environ={"HETSPEC_GPU_WORKER__DEVICE": "cpu"})
    spec = worker_specs(config, "json", gpu_runtime="native")["gpu"]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy, hit = asyncio.run(measure(spec, [1, 4], 120, tmp_path))
    finally:
        spinner.kill()
        spinner.wait()
    assert isinstance(busy, RuntimeProfile)
    assert not hit
    assert not list((tmp_path / "profiles").glob("*.json"))
    quiet, hit = asyncio.run(measure(spec, [1, 4], 120, tmp_path))
    assert isinstance(quiet, RuntimeProfile)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    assert asyncio.run(measure(spec, [1, 4], 120, tmp_path))[1]  # now from the cache


@pytest.mark.process
def test_a_runtime_that_cannot_hold_the_model_is_skipped_with_its_reason(tmp_path) -> None:
    """A target given as GGUF only (its folder holds no torch model): a GGUF runtime is chosen."""
    folder = tmp_path / "gguf-only"
    folder.mkdir()
    config = load_config(
        environ={
            "HETSPEC_GPU_WORKER__DEVICE": "cpu",
            "HETSPEC_TARGET__FOLDER": str(folder),
            "HETSPEC_TARGET__GGUF": str(TARGET_GGUF),
        }
    )
    decision = asyncio.run(decide_gpu_runtime(config, cache=tmp_path / "cache"))
    assert decision.runtime in {"llama.cpp", "native"}
    assert [f.runtime for f in decision.failures] == ["torch"]
    assert "gguf-only" in decision.failures[0].message
    assert "torch unusable" in decision.summary()


def test_a_cuda_verifier_is_profiled_on_both_sides_of_each_forward_it_adds() -> None:
    """Its forwards are 16 rows wide: a chain of 17 costs two, of 33 three. Priced from
    16 and 32 alone, 33 would cost about 32's two forwards."""
    assert set(VERIFY_WIDTHS) <= set(CUDA_VERIFY_WIDTHS)
    for forwards in range(1, 4):
        assert {16 * forwards, 16 * forwards + 1} <= set(CUDA_VERIFY_WIDTHS)
    assert max(CUDA_VERIFY_WIDTHS) == max(VERIFY_WIDTHS) == 64


@pytest.mark.process
def test_where_cuda_verifies_cpu_only_runtimes_are_not_timed(tmp_path) -> None:
    """On a GPU box the GPU worker owns one core: timing the target there on CPU kernels
    took minutes for a 1B target. Here (no CUDA) torch on "cuda" then fails too, and the
    error names all three reasons."""
    from hetspec.daemon.load.runtime_check import check_runtime  # noqa: PLC0415
    from hetspec.daemon.load.runtime_trials import RuntimeChoiceError  # noqa: PLC0415

    if getattr(check_runtime("llama.cpp"), "gpu_offload", False):
        pytest.skip("this llama.cpp build offloads: it is a candidate on a GPU box")
    config = load_config(environ={"HETSPEC_GPU_WORKER__DEVICE": "cuda"})
    with pytest.raises(RuntimeChoiceError) as error:
        asyncio.run(decide_gpu_runtime(config, cache=tmp_path))
    said = str(error.value)
    assert "native: CPU kernels only, and this box verifies on CUDA" in said
    assert "llama.cpp: this llama.cpp build cannot offload to the GPU" in said
    assert "torch:" in said


def test_a_configured_runtime_is_used_without_measuring(tmp_path) -> None:
    config = load_config(environ={"HETSPEC_GPU_RUNTIME": "torch"})
    decision = asyncio.run(decide_gpu_runtime(config, cache=tmp_path))
    assert (decision.runtime, decision.chosen_by, decision.profiles) == (
        "torch",
        "configuration",
        [],
    )
    assert decision.verifier_costs_s() is None  # nothing measured: rounds measure it
    assert not list(tmp_path.iterdir())


@pytest.mark.process
def test_the_daemon_says_what_it_chose_and_why(tmp_path) -> None:
    (tmp_path / "daemon").mkdir()
    daemon = BundledDaemon(
        tmp_path / "daemon",
        "draft-cpu",
        "--set",
        'gpu_runtime="auto"',
        env={"HETSPEC_CACHE_DIR": str(tmp_path / "cache")},
    )
    try:
        status, props = request(daemon.socket, "GET", "/props")
        assert status == 200
        choice = props["gpu_runtime"]
        assert choice["chosen_by"] == "measurement"
        assert {p["runtime"] for p in choice["profiles"]} == {"llama.cpp", "native", "torch"}
        assert props["workers"]["gpu"]["model"].endswith(
            "target" if choice["runtime"] == "torch" else ".gguf"
        )
        logged = [
            msgspec.json.decode(line)
            for line in daemon.log.read_bytes().splitlines()
            if b"gpu worker runtime" in line
        ]
        assert logged[0]["runtime"] == choice["runtime"]
        assert "T(1)=" in logged[0]["summary"]
    finally:
        daemon.stop()


def test_rebuilt_native_kernels_are_measured_anew() -> None:
    """The native runtime's cached figures are keyed on the built library: new kernels (a
    rebuild) must not be ranked by the old ones' speed. The other runtimes' keys stay."""
    config = load_config(environ={"HETSPEC_GPU_WORKER__DEVICE": "cpu"})
    specs = {
        runtime: worker_specs(config, "json", gpu_runtime=runtime)["gpu"]
        for runtime in ("native", "llama.cpp")
    }
    library = Path(importlib.util.find_spec("hetspec.native._hsnative").origin)
    before = {runtime: profile_key(spec, [1, 8]) for runtime, spec in specs.items()}
    stat = library.stat()
    try:
        os.utime(library, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        after = {runtime: profile_key(spec, [1, 8]) for runtime, spec in specs.items()}
    finally:
        os.utime(library, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert after["native"] != before["native"]
    assert after["llama.cpp"] == before["llama.cpp"]


def test_the_drafter_takes_the_fewest_threads_that_are_about_as_fast() -> None:
    assert thread_counts(1) == [1]
    assert thread_counts(2) == [1, 2]
    assert thread_counts(6) == [1, 2, 4, 6]
    assert thread_counts(16) == [1, 2, 4, 8, 16]
    # a tiny draft on a big box: waiting for 15 threads costs more than it computes
    assert fewest_fast_threads({1: 0.104, 2: 0.10, 4: 0.14, 16: 0.32}) == 1
    assert fewest_fast_threads({1: 0.11, 2: 0.10, 4: 0.14, 16: 0.32}) == 2
    assert fewest_fast_threads({1: 0.60, 2: 0.33, 4: 0.20, 8: 0.198}) == 4
    with pytest.raises(ValueError, match="no thread count"):
        fewest_fast_threads({})


def test_the_fastest_drafter_is_the_cheapest_token_at_its_fewest_fast_threads() -> None:
    llama = {1: 0.18, 2: 0.23}
    # 0.09 is more than 5% below 0.10: two threads pay; 0.099 is not
    assert fastest_drafter({"llama.cpp": llama, "native": {1: 0.10, 2: 0.09}}) == ("native", 2)
    assert fastest_drafter({"llama.cpp": llama, "native": {1: 0.10, 2: 0.099}}) == ("native", 1)
    # within the tolerance the runtime listed first keeps its place
    assert fastest_drafter({"llama.cpp": {1: 0.100}, "native": {1: 0.098}}) == ("llama.cpp", 1)
    assert fastest_drafter({"llama.cpp": {}, "native": {4: 0.2}}) == ("native", 4)
    with pytest.raises(ValueError, match="no drafting runtime"):
        fastest_drafter({"llama.cpp": {}})


@pytest.mark.process
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_drafter_s_runtime_and_threads_are_measured_and_given_to_its_worker(tmp_path) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    config = load_config(
        environ={"HETSPEC_GPU_WORKER__DEVICE": "cpu", "HETSPEC_CPU_WORKER__CORES": str(cores)}
    )
    choice = asyncio.run(decide_drafter(config, cache=tmp_path))
    assert choice is not None
    assert choice.chosen_by == "measurement"
    timed = {name: sorted(by) for name, by in choice.costs_ms.items()}
    assert timed == {"llama.cpp": [1, 2], "native": [1, 2]}
    assert all(ms > 0 for by in choice.costs_ms.values() for ms in by.values())
    assert (choice.runtime, choice.threads) == fastest_drafter(choice.costs_ms)
    assert choice.draft_ms() == choice.costs_ms[choice.runtime][choice.threads]
    # each runtime's worker as it was timed: llama.cpp's batches on both cores
    for runtime in ("llama.cpp", "native"):
        spec = worker_specs(config, "json", "torch", 1, runtime)["cpu"]
        assert (spec.runtime, spec.settings.threads) == (runtime, 1)
        if runtime == "llama.cpp":
            assert spec.settings.threads_batch == 2
    # a configured runtime with configured threads: nothing to measure
    configured = load_config(
        environ={
            "HETSPEC_CPU_WORKER__THREADS": "1",
            "HETSPEC_CPU_RUNTIME": "native",
            "HETSPEC_CPU_WORKER__CORES": str(cores),
        }
    )
    chosen = asyncio.run(decide_drafter(configured))
    assert (chosen.runtime, chosen.threads, chosen.chosen_by) == ("native", 1, "configuration")
    assert worker_specs(configured, "json", "torch")["cpu"].runtime == "native"
    # one core, one runtime: the same
    one = load_config(
        environ={"HETSPEC_CPU_WORKER__CORES": str(cores[:1]), "HETSPEC_CPU_RUNTIME": "llama.cpp"}
    )
    assert asyncio.run(decide_drafter(one, cache=tmp_path)).chosen_by == "configuration"
    # draft-gpu: the CPU worker verifies in llama.cpp; native cannot be asked for there
    dovetail = load_config(environ={"HETSPEC_PLACEMENT": "draft-gpu"})
    assert asyncio.run(decide_drafter(dovetail)) is None
    assert worker_specs(dovetail, "json", "torch")["cpu"].runtime == "llama.cpp"
    with pytest.raises(ConfigError, match="cpu_runtime"):
        load_config(environ={"HETSPEC_PLACEMENT": "draft-gpu", "HETSPEC_CPU_RUNTIME": "native"})

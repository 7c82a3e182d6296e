"""``hetspec models check TARGET DRAFT``, as a user runs it (the shell command), on real model
files: the bundled pair, a pair that does not share a tokenizer, and bad arguments."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from hetspec.daemon.config import BUNDLED_MODELS

pytestmark = pytest.mark.process  # the shell client, for most


def check(*paths: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetspec.client.cli", "models", "check", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def config_of(stdout: str) -> dict:
    return tomllib.loads(stdout.split("hetspecd.toml:\n", 1)[1])


def test_the_bundled_pair_can_be_served_everywhere() -> None:
    target = BUNDLED_MODELS / "target" / "target-q8_0.gguf"
    done = check(target, BUNDLED_MODELS / "draft" / "draft-q8_0.gguf")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "target: llama, 5.05M parameters, trained context 2048" in out
    assert "vocabulary: shared (bpe, 4096 tokens)" in out
    assert out.count("can serve") == 5  # draft-cpu: torch, llama.cpp, native; draft-gpu: two
    assert "cannot serve" not in out
    assert "GPU worker verifies with torch on the target's folder" in out
    assert "drafts with llama.cpp on the draft's GGUF" in out
    assert '(or the native kernels, where they draft faster: cpu_runtime "auto")' in out
    assert "KV cache" in out
    torch_line = next(line for line in out.splitlines() if "verifies with torch" in line)
    assert "in float32 on a CPU" in torch_line  # the torch worker's own dtype on each device
    assert "in bfloat16 on CUDA" in torch_line
    assert "shared memory for probability rows: 8.4 MB" in out
    config = config_of(out)
    assert Path(config["target"]["gguf"]) == target.resolve()
    assert Path(config["target"]["folder"]) == (BUNDLED_MODELS / "target").resolve()
    assert Path(config["draft"]["folder"]).is_dir()
    head = BUNDLED_MODELS / "head"
    assert f"  {head}: matches" in out
    assert f"  drafts with: {head}" in out


def test_k_quant_files_run_on_the_native_kernels_and_other_types_are_named(tmp_path) -> None:
    """A Q4_K_M file (here with Q5_0 and Q8_0 tensors too: llama.cpp's choice for rows that are
    not whole super-blocks) can be verified by the native kernels; a type they do not read is
    named."""
    from hetspec.daemon.load.model_check import Side, find_exports  # noqa: PLC0415
    from hetspec.models.llama_quantize import quantize_gguf  # noqa: PLC0415

    target = quantize_gguf(
        BUNDLED_MODELS / "target" / "target-f16.gguf",
        tmp_path / "target-q4_k_m.gguf",
        "q4_k_m",
        threads=1,
    )
    done = check(target, BUNDLED_MODELS / "draft" / "draft-q8_0.gguf")
    assert done.returncode == 0, done.stdout + done.stderr
    assert 'gpu_runtime "native": can serve' in done.stdout
    assert done.stdout.count("can serve") == 4  # not torch: this GGUF has no folder beside it
    model = find_exports("target", target)
    assert model.gguf_facts.tensor_types == {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"}
    other = replace(model.gguf_facts, tensor_types=model.gguf_facts.tensor_types | {"IQ3_S"})
    side = Side("verifies", "CPU worker", "native", replace(model, gguf_facts=other))
    assert side.unusable() == (
        "the native kernels read F16, F32, IQ4_NL, IQ4_XS, Q4_0, Q4_1, "
        "Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 tensors; this Q4_K_M file has "
        "IQ3_S"
    )


def test_a_draft_with_another_tokenizer_is_refused_as_the_daemon_would(models) -> None:
    done = check(models["target"], models["other"])
    assert done.returncode == 1
    assert "vocabulary: NOT shared" in done.stdout
    assert "vocabulary sizes differ" in done.stdout or "token texts differ" in done.stdout
    assert "can serve" not in done.stdout


def test_a_gguf_alone_serves_where_no_torch_side_needs_a_folder(models, tmp_path) -> None:
    alone = tmp_path / "target.gguf"  # no config.json beside it
    shutil.copy(models["target"], alone)
    done = check(alone, models["draft"])
    assert done.returncode == 0, done.stdout
    out = done.stdout
    assert "  folder: none" in out
    assert "GPU worker verifies with torch on the target's folder: NO, needs a model folder" in out
    assert 'gpu_runtime "llama.cpp": can serve' in out
    assert config_of(out)["target"]["folder"] == ""
    assert "a head reads the target's folder (its LM head), there is none" in out


def test_bad_arguments_get_one_line_each(tmp_path) -> None:
    missing = check(tmp_path / "nothing", BUNDLED_MODELS / "draft")
    assert missing.returncode == 2
    assert missing.stderr.strip().endswith("nothing: no such file or folder")
    several = check(BUNDLED_MODELS / "target", BUNDLED_MODELS / "draft")
    assert several.returncode == 2
    assert "several GGUF files (target-f16.gguf, target-q8_0.gguf); name one" in several.stderr
    (tmp_path / "notes.txt").write_text("x")
    assert check(tmp_path / "notes.txt", BUNDLED_MODELS / "draft").returncode == 2
    assert "Traceback" not in missing.stderr + several.stderr


def test_the_checks_idea_of_the_native_kernels_is_theirs() -> None:
    """The daemon may not import the native package (it checks files before any worker
    runs), so it keeps its own list of what the kernels read: the same list."""
    from hetspec.daemon.load.model_check import NATIVE_FAMILIES, NATIVE_TENSOR_TYPES  # noqa: PLC0415
    from hetspec.native.kernels import TYPE_NAMES  # noqa: PLC0415
    from hetspec.native.model import FAMILIES  # noqa: PLC0415

    assert set(NATIVE_TENSOR_TYPES) == set(TYPE_NAMES.values())
    assert set(NATIVE_FAMILIES) == set(FAMILIES)


def test_the_checks_idea_of_the_torch_runtime_is_its_own() -> None:
    from hetspec.daemon.load.model_check import TORCH_MODEL_TYPES  # noqa: PLC0415
    from hetspec.workers.runtimes.torch_runtime.config import ARCHITECTURES  # noqa: PLC0415

    assert set(TORCH_MODEL_TYPES) == set(ARCHITECTURES)

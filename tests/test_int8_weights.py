"""int8 weights (a float32 scale per output row) read by the Triton matmul: the sums, each
row's bits alone and among others, a verifier of an int8 model keeping its tokens' bits in
any tree, and the setting refused where the kernel cannot run. On the CPU the kernels run in
Triton's interpreter; the compile-ahead checks build them for each GPU kind."""

from __future__ import annotations

import json

import pytest
import torch
from test_skinny_matmul import GPUS, compile_for
from tiny_models import (
    build_reference,
    compiled_beside_eager,
    save_reference,
    write_tiny_gguf_llama,
)

from hetspec.protocol import worker_messages as m
from hetspec.workers.process import load_runtime
from hetspec.workers.runtimes.torch_runtime import ModelLoadError, TorchRuntime, skinny_matmul
from hetspec.workers.runtimes.torch_runtime.int8_weights import Int8Linear, quantize_rows
from hetspec.workers.runtimes.torch_runtime.skinny_matmul import MAX_ROWS, launches

triton = pytest.importorskip("triton", reason="Triton is not installed (the test extra has it)")
PROMPT = [1, 5, 9, 14, 2, 33, 7, 21, 40, 11]


def int8_linear(x, weight, scale, bias=None):
    """A call of an int8 layer, as ``Int8Linear`` makes it."""
    return skinny_matmul.linear(x, weight, bias, scale=scale)


def widened(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.double() * scale.double()[:, None]


def test_a_row_keeps_its_largest_magnitude_and_loses_at_most_half_a_step() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 50, generator=generator) * torch.tensor([1, 10, 1e-3, 5, 0, 2])[:, None]
    quantized, scale = quantize_rows(weight)
    assert quantized.dtype == torch.int8
    assert scale.dtype == torch.float32
    assert quantized.abs().amax(dim=1).tolist() == [127, 127, 127, 127, 0, 127]
    assert scale[4] == 1
    assert not quantized[4].any()
    error = (widened(quantized, scale) - weight.double()).abs()
    assert (error <= scale.double()[:, None] / 2 + 1e-9).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "splits"), [(600, 2), (250, 1)])  # one split: scaled directly
def test_int8_sums_match_float64_and_no_row_depends_on_the_others(interpreted, dtype, k, splits):
    generator = torch.Generator().manual_seed(1)
    n = 200
    assert skinny_matmul.SplitPlan.of(n, k, 132).splits == splits
    weight, scale = quantize_rows(torch.randn(n, k, generator=generator))
    bias = torch.randn(n, generator=generator).to(dtype)
    x = torch.randn(MAX_ROWS, k, generator=generator).to(dtype)
    y = int8_linear(x, weight, scale, bias)
    assert y.dtype == dtype
    assert y.shape == (MAX_ROWS, n)
    exact = x.double() @ widened(weight, scale).T + bias.double()
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(y.double(), exact, rtol=tolerance, atol=tolerance)
    for rows in (1, 4, MAX_ROWS - 1):
        company = torch.randn(rows - 1, k, generator=generator).to(dtype)
        assert torch.equal(
            int8_linear(torch.cat([x[3:4], company]), weight, scale, bias)[0], y[3]
        ), rows
    wide = int8_linear(torch.cat([x, x[:1]]), weight, scale, bias)  # a prefill's rows: torch
    torch.testing.assert_close(wide[:MAX_ROWS].double(), exact, rtol=tolerance, atol=tolerance)


def test_the_kernel_takes_an_int8_weight_only_with_its_scale(interpreted) -> None:
    weight, scale = quantize_rows(torch.randn(8, 32))
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="an int8 weight comes with a scale per row"):
        skinny_matmul.skinny_linear(x, weight)
    with pytest.raises(ValueError, match="an int8 weight comes with a scale per row"):
        skinny_matmul.skinny_linear(x, x, scale=scale)
    with pytest.raises(ValueError, match=r"the scale is float32 of shape \(8,\)"):
        skinny_matmul.skinny_linear(x, weight, scale=scale.double())
    with pytest.raises(ValueError, match=r"a torch\.bfloat16 weight for torch\.float32 rows"):
        skinny_matmul.skinny_linear(x, torch.randn(8, 32).bfloat16())


@pytest.mark.parametrize("name", ["llama-linear-bias-tied", "qwen3"])  # tied head, own head
def test_an_int8_verifier_keeps_its_tokens_bits_alone_and_in_trees(interpreted, tmp_path, name):
    """The int8 model's logits track the same model with its weights widened back in
    float32 through torch, and a token's logits are bit-identical alone and in a tree."""
    folder = save_reference(build_reference(name), tmp_path / "m")
    options = {"device": "cpu", "dtype": "float32", "fixed_width": 4, "max_context": 64}
    ours = TorchRuntime(folder, weights="int8", **options)
    plain = TorchRuntime(folder, **options)
    layers = [mod for mod in ours.model.modules() if isinstance(mod, Int8Linear)]
    assert layers
    assert all(layer.weight.dtype == torch.int8 for layer in layers)
    assert ours.model.quantized_head is not None
    assert not any(type(mod) is torch.nn.Linear for mod in ours.model.modules())
    with torch.no_grad():  # the plain model gets the int8 model's weights, widened
        for (_, mine), (_, theirs) in zip(_linears(ours.model), _linears(plain.model), strict=True):
            theirs.weight.copy_(widened(mine.weight, mine.scale).float())
        head = ours.model.quantized_head
        head_weight = widened(head.weight, head.scale).float()  # a tied embedding stays as is
        plain.model.head_linear = lambda x, _full: torch.nn.functional.linear(x, head_weight)
    for runtime in (ours, plain):
        runtime.prefill(PROMPT)
    torch.testing.assert_close(ours.last_logits(), plain.last_logits(), rtol=1e-4, atol=1e-4)
    tree = ([3, 4, 5, 6, 7], [-1, 0, 0, 2, 1])  # two forwards of four
    logits = ours.forward_tree(*tree).logits.clone()
    torch.testing.assert_close(logits, plain.forward_tree(*tree).logits, rtol=1e-4, atol=1e-4)
    ours.discard_pending()
    for node, chain in ((0, [3]), (2, [3, 5]), (3, [3, 5, 6]), (4, [3, 4, 7])):
        alone = ours.forward_tree(chain, list(range(-1, len(chain) - 1))).logits[-1]
        ours.discard_pending()
        assert torch.equal(alone, logits[node]), node


@pytest.mark.process  # torch.compile runs a compiler
@pytest.mark.slow
def test_a_compiled_int8_verifier_tracks_the_eager_one_and_keeps_its_bits(interpreted, tmp_path):
    """int8 weights through torch.compile: the same logits as eager int8 (the kernel is the
    same op, the small kernels between fused), and a token's bits the same alone and in a
    tree."""
    folder = save_reference(build_reference("llama-linear-bias-tied"), tmp_path / "m")
    options = {
        "device": "cpu",
        "dtype": "float32",
        "fixed_width": 4,
        "max_context": 64,
        "weights": "int8",
    }
    compiled, eager = compiled_beside_eager(folder, PROMPT, **options)
    torch.testing.assert_close(compiled.last_logits(), eager.last_logits(), rtol=1e-5, atol=1e-5)
    tree = ([3, 4, 5, 6], [-1, 0, 0, 2])
    logits = compiled.forward_tree(*tree).logits.clone()
    torch.testing.assert_close(logits, eager.forward_tree(*tree).logits, rtol=1e-5, atol=1e-5)
    compiled.discard_pending()
    assert torch.equal(compiled.forward_tree([3, 5], [-1, 0]).logits[1], logits[2])


def _linears(model):
    """The linear layers in model order, by their names (a plain model's, an int8 one's)."""
    kinds = (torch.nn.Linear, Int8Linear)
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, kinds) and name != "quantized_head"
    ]


def test_int8_weights_halve_the_bytes_and_the_worker_says_so(interpreted, tmp_path) -> None:
    folder = write_tiny_gguf_llama(tmp_path / "m", seed=0, layers=1).parent  # a tokenizer too
    settings = m.TorchSettings(device="cpu", dtype="bfloat16", weights="int8")
    runtime, described = load_runtime("torch", str(folder), settings)
    assert described == "cpu (int8 weights)"
    plain = TorchRuntime(folder, device="cpu", dtype="bfloat16")

    def linear_bytes(model) -> int:
        return sum(
            t.numel() * t.element_size()
            for _, mod in _linears(model)
            for t in (mod.weight, getattr(mod, "scale", None))
            if t is not None
        )

    ratio = linear_bytes(runtime.model) / linear_bytes(plain.model)
    assert 0.5 <= ratio < 0.53  # int8 plus a float32 scale per row of a few dozen values
    runtime.prefill(PROMPT[:4])
    assert runtime.last_logits().shape[-1] == runtime.vocab_size


def test_int8_weights_are_refused_where_the_kernel_cannot_run(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    with pytest.raises(
        ModelLoadError,
        match=r'weights "int8" \(read by the Triton matmul\) '
        "cannot run here: Triton compiles",
    ):
        TorchRuntime(folder, device="cpu", weights="int8")
    with pytest.raises(ModelLoadError, match='weights must be "dtype" or "int8", not'):
        TorchRuntime(folder, device="cpu", weights="int4")


@pytest.mark.process  # triton runs ptxas
@pytest.mark.parametrize("capability", sorted(GPUS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_int8_kernels_compile_for_each_gpu_within_its_shared_memory(capability, dtype):
    """As bfloat16's (test_skinny_matmul): both kernels, the weight's loads pipelined, the
    buffers within the GPU's shared memory, now with a weight tile of one byte a value."""
    for n, k in ((4096, 4096), (96, 256)):
        x = torch.empty(MAX_ROWS, k, dtype=dtype, device="meta")
        weight = torch.empty(n, k, dtype=torch.int8, device="meta")
        scale = torch.empty(n, dtype=torch.float32, device="meta")
        calls = launches(x, weight, None, shared=GPUS[capability], scale=scale)[1]
        assert calls[0].constants["SCALED"]
        assert calls[0].constants["WIDEN"]
        compiled = compile_for(calls[0], capability)
        assert 0 < compiled.metadata.shared <= GPUS[capability]
        assert "cp.async" in compiled.asm["ptx"]
        for call in calls[1:]:
            assert compile_for(call, capability).metadata.shared <= GPUS[capability]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_int8_kernel_tracks_its_widened_weight_and_rows_stay_independent(dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight, scale = quantize_rows(torch.randn(4096, 4096, device="cuda", generator=generator))
    x = torch.randn(MAX_ROWS, 4096, device="cuda", generator=generator).to(dtype)
    y = int8_linear(x, weight, scale)
    exact = x.double() @ widened(weight, scale).T
    tolerance = 1e-4 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(y.double(), exact, rtol=tolerance, atol=tolerance)
    for rows in (1, 2, 9):
        assert torch.equal(int8_linear(x[:rows], weight, scale), y[:rows]), rows


@pytest.mark.process
def test_a_daemon_with_an_int8_verifier_returns_its_target_alones_greedy_text(tmp_path):
    """Through the real daemon (its torch verifier in a GPU's fixed width, int8 weights, the
    kernels interpreted): speculative rounds return what the int8 target alone returns."""
    from test_lossless import BundledDaemon  # noqa: PLC0415 (its module-scoped fixtures)

    settings = ("gpu_worker.fixed_width=16", 'gpu_worker.weights="int8"')
    daemon = BundledDaemon(
        tmp_path,
        "draft-cpu",
        *(a for s in settings for a in ("--set", s)),
        env={"TRITON_INTERPRET": "1"},
    )
    try:
        prompt, options = "def read_lines(path):", {"max_tokens": 6, "ignore_eos": True}
        alone = daemon.generate(prompt, mode="autoregressive", **options)["tokens"]
        assert len(alone) == 6
        for mode in ({"mode": "sequential", "gamma": 4}, {"mode": "parallel", "gamma": 2}):
            body = daemon.generate(prompt, **options, **mode)
            assert body["tokens"] == alone, mode
            assert body["timings"]["draft_n"] > 0
    finally:
        daemon.stop()
    assert "int8 weights" in daemon.log.read_text()


def test_a_kernel_that_strays_is_refused_at_load(interpreted, tmp_path, monkeypatch) -> None:
    """Checked at load on the first layer and the head (for matmul "triton" before any layer
    changes): a kernel that fails or strays makes matmul "triton" fall back to torch's matmul
    (the device line says why) and int8 weights a load error (their fallback would be no
    faster)."""
    folder = write_tiny_gguf_llama(tmp_path / "m", seed=0, layers=1).parent
    weight = torch.randn(64, 96)
    quantized, scale = quantize_rows(weight)
    assert skinny_matmul.kernel_problem(weight, torch.float32) is None
    assert skinny_matmul.kernel_problem(quantized, torch.bfloat16, scale=scale) is None
    right = skinny_matmul.skinny_linear
    monkeypatch.setattr(
        skinny_matmul, "skinny_linear", lambda *args, **kwargs: right(*args, **kwargs) * 1.5
    )
    assert "differ from torch's by" in skinny_matmul.kernel_problem(weight, torch.float32)
    settings = m.TorchSettings(device="cpu", matmul="triton")
    runtime, described = load_runtime("torch", str(folder), settings)
    assert runtime.matmul_refused.startswith("its sums differ from torch's by")
    assert described.startswith("cpu (matmul torch: the Triton kernel refused: its sums differ")
    assert not any(isinstance(mod, skinny_matmul.SkinnyLinear) for mod in runtime.model.modules())
    refused = r'weights "int8" \(read by the Triton matmul\): the kernel cannot serve them here'
    with pytest.raises(ModelLoadError, match=refused):
        TorchRuntime(folder, device="cpu", weights="int8")

    def broken(*args, **kwargs):
        raise RuntimeError("PTX not supported\nmore")

    monkeypatch.setattr(skinny_matmul, "skinny_linear", broken)
    assert skinny_matmul.kernel_problem(weight, torch.float32) == "RuntimeError: PTX not supported"


def test_a_model_too_big_for_the_gpu_is_a_load_error_that_says_what_helps(tmp_path, monkeypatch):
    """CUDA's out-of-memory error at load (no GPU here: raised where the model is built)
    becomes a load error naming the folder and the settings that shrink what it needs."""
    from hetspec.workers import process  # noqa: PLC0415

    folder = write_tiny_gguf_llama(tmp_path / "m", seed=0, layers=1).parent

    def too_big(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setattr("hetspec.workers.runtimes.torch_runtime.TorchRuntime", too_big)
    with pytest.raises(process.LoadError) as refused:
        load_runtime("torch", str(folder), m.TorchSettings(device="cpu"))
    assert str(refused.value) == (
        f"{folder} does not fit in the GPU's free memory (CUDA out of memory. Tried to allocate "
        "2.00 GiB): a smaller gpu_worker.max_context shrinks its KV cache, gpu_worker.weights = "
        '"int8" halves its weights'
    )


@pytest.mark.slow
def test_bench_verify_times_an_int8_verifier_and_says_so(
    interpreted, tmp_path, capsys, monkeypatch
) -> None:
    from hetspec.bench import torch_verify as bench_verify  # noqa: PLC0415
    from hetspec.workers.runtimes.torch_runtime import static_forward  # noqa: PLC0415

    for module in (static_forward, bench_verify):  # the invariance chain crosses span 16's end
        monkeypatch.setattr(module, "MIN_SPAN", 16)
    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    out = tmp_path / "verify.json"
    arguments = [
        "--model",
        str(folder),
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--fixed-width",
        "4",
        "--contexts",
        "20",
        "--widths",
        "1,4",
        "--repeats",
        "1",
        "--weights",
        "int8",
        "--invariance",
        "--json",
        str(out),
    ]
    assert bench_verify.main(arguments) == 0
    assert "matmul triton, int8 weights" in capsys.readouterr().out
    table = json.loads(out.read_text())
    assert (table["weights"], table["matmul_refused"]) == ("int8", None)
    assert not sum(row["rows_differ"] for row in table["invariance"])

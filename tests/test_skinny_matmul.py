"""The Triton linear layer for few rows: exact sums, rows that do not depend on each other,
and the torch runtime verifying through it. On the CPU the kernels run in Triton's
interpreter (the same kernel code, numpy underneath); on CUDA, compiled."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from tiny_models import (
    build_reference,
    compiled_beside_eager,
    save_reference,
    write_tiny_gguf_llama,
)

from hetspec.bench.torch_matmul import HEAVY_1B, TILINGS
from hetspec.protocol import worker_messages as m
from hetspec.workers.process import LoadError, load_runtime
from hetspec.workers.runtimes.torch_runtime import ModelLoadError, TorchRuntime, skinny_matmul
from hetspec.workers.runtimes.torch_runtime.skinny_matmul import (
    DEFAULT_TILING,
    MAX_ROWS,
    Launch,
    SplitPlan,
    Tiling,
    launches,
    skinny_linear,
    unavailable_reason,
)

triton = pytest.importorskip("triton", reason="Triton is not installed (the test extra has it)")
PROMPT = [1, 5, 9, 14, 2, 33, 7, 21, 40, 11]


def test_a_weight_is_cut_by_its_shape_and_the_gpu_alone() -> None:
    for n, k in ((4096, 4096), (11264, 4096), (4096, 11264), (96, 64), (32000, 4096)):
        plan = SplitPlan.of(n, k, sm_count=132)
        assert plan.splits * plan.k_per_split >= k > (plan.splits - 1) * plan.k_per_split
        assert plan.k_per_split % DEFAULT_TILING.block_k == 0
        assert plan.splits == 1 or plan.k_per_split >= 2 * DEFAULT_TILING.block_k
    # a square 4096 layer: 64 column blocks, split in 8 ranges of 512 -> 512 programs
    assert SplitPlan.of(4096, 4096, 132) == SplitPlan(64, 8, 512)
    assert SplitPlan.of(96, 64, 132).splits == 1  # too short a K to split
    assert SplitPlan.of(4096, 4096, 132, Tiling(programs_per_sm=0)).splits == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("k", "splits"), [(600, 2), (250, 1)])  # one split: no second kernel
def test_sums_match_float64_and_no_row_depends_on_the_others(interpreted, dtype, k, splits):
    generator = torch.Generator().manual_seed(0)
    n = 200  # neither N nor K a multiple of its block
    assert SplitPlan.of(n, k, 132).splits == splits
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    x = torch.randn(MAX_ROWS, k, generator=generator).to(dtype)
    y = skinny_linear(x, weight, bias)
    assert y.dtype == dtype
    assert y.shape == (MAX_ROWS, n)
    exact = x.double() @ weight.double().T + bias.double()
    # float32 sums of exact products, then one rounding to the output's type
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(y.double(), exact, rtol=tolerance, atol=tolerance)
    for rows in (1, 3, 7, MAX_ROWS - 1):  # the same row among others of any count
        company = torch.randn(rows - 1, k, generator=generator).to(dtype)
        alone = skinny_linear(torch.cat([x[5:6], company]), weight, bias)[0]
        assert torch.equal(alone, y[5]), rows
    no_bias = skinny_linear(x[:2].reshape(2, 1, k), weight)  # leading shape kept
    assert no_bias.shape == (2, 1, n)
    torch.testing.assert_close(
        no_bias[:, 0].double(), exact[:2] - bias.double(), rtol=tolerance, atol=tolerance
    )


def test_more_rows_than_a_tile_or_a_wrong_width_is_refused(interpreted) -> None:
    weight = torch.randn(8, 32)
    with pytest.raises(ValueError, match="at most 16 rows, not 17"):
        skinny_linear(torch.randn(17, 32), weight)
    with pytest.raises(ValueError, match="x has 31 columns but the weight 32"):
        skinny_linear(torch.randn(2, 31), weight)
    x = torch.randn(17, 32)  # the layer hands more rows to torch
    torch.testing.assert_close(skinny_matmul.linear(x, weight), x @ weight.T)


def test_a_fixed_width_verifier_through_the_kernel_keeps_the_logits(interpreted, tmp_path):
    """float32 through the kernel tracks float32 through torch, the greedy chain is the
    same, and a token's logits stay bit-identical alone and inside a tree."""
    folder = save_reference(build_reference("llama-linear-bias-tied"), tmp_path / "m")
    options = {"device": "cpu", "dtype": "float32", "fixed_width": 4, "max_context": 64}
    ours = TorchRuntime(folder, matmul="triton", **options)
    plain = TorchRuntime(folder, **options)
    assert type(ours.model.model.layers[0].mlp.up_proj).__name__ == "SkinnyLinear"
    for runtime in (ours, plain):
        runtime.prefill(PROMPT)
    torch.testing.assert_close(ours.last_logits(), plain.last_logits(), rtol=1e-4, atol=1e-4)
    tree = ([3, 4, 5, 6], [-1, 0, 0, 2])
    logits = ours.forward_tree(*tree).logits.clone()
    torch.testing.assert_close(logits, plain.forward_tree(*tree).logits, rtol=1e-4, atol=1e-4)
    ours.discard_pending()
    alone = ours.forward_tree([3], [-1]).logits[0]
    assert torch.equal(alone, logits[0])


@pytest.mark.process  # torch.compile runs a compiler
@pytest.mark.slow
def test_compiled_the_kernel_stays_one_op_a_layer(interpreted, tmp_path, monkeypatch) -> None:
    """torch.compile with matmul "triton": every linear layer of a compiled forward is still
    the kernel (inductor fuses around it, never replaces it), the logits track eager's, and
    a token's logits are bit-identical alone and inside a tree."""
    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    options = {
        "device": "cpu",
        "dtype": "float32",
        "fixed_width": 4,
        "max_context": 64,
        "matmul": "triton",
    }
    compiled, eager = compiled_beside_eager(folder, PROMPT, **options)
    calls = []
    real = skinny_matmul.launches
    monkeypatch.setattr(skinny_matmul, "launches", lambda *a, **k: calls.append(1) or real(*a, **k))
    tree = ([3, 4, 5, 6], [-1, 0, 0, 2])
    logits = compiled.forward_tree(*tree).logits.clone()  # one forward of four rows
    layers = sum(isinstance(mod, skinny_matmul.SkinnyLinear) for mod in compiled.model.modules())
    assert len(calls) == layers  # the output head among them
    torch.testing.assert_close(logits, eager.forward_tree(*tree).logits, rtol=1e-4, atol=1e-4)
    compiled.discard_pending()
    assert torch.equal(compiled.forward_tree([3], [-1]).logits[0], logits[0])


def test_the_kernel_is_refused_where_it_cannot_run(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    assert "not for cpu" in unavailable_reason(torch.device("cpu"))
    with pytest.raises(ModelLoadError, match='matmul "triton" cannot run here: Triton compiles'):
        TorchRuntime(folder, device="cpu", matmul="triton")
    with pytest.raises(ModelLoadError, match="matmul must be"):
        TorchRuntime(folder, device="cpu", matmul="cutlass")


def test_a_worker_cuts_its_layers_by_the_configured_tiling(interpreted, tmp_path) -> None:
    """The worker's loader turns ``TorchSettings.matmul_tiling`` into every layer's tiling
    (the output head's too); a tiling that cannot be, or one without the kernel, is a load
    error that says why."""
    folder = str(write_tiny_gguf_llama(tmp_path / "m", seed=0, layers=1).parent)
    settings = m.TorchSettings(
        device="cpu", matmul="triton", matmul_tiling=m.MatmulTiling(block_n=32, warps=8)
    )
    runtime, _ = load_runtime("torch", folder, settings)
    cut = Tiling(block_n=32, warps=8)
    layers = [mod for mod in runtime.model.modules() if isinstance(mod, skinny_matmul.SkinnyLinear)]
    assert layers
    assert all(layer.tiling == cut for layer in layers)
    assert runtime.model.head_linear.keywords == {"tiling": cut}
    plain = TorchRuntime(folder, device="cpu")
    for each in (runtime, plain):
        each.prefill(PROMPT[:3])  # through the layers cut so, and through torch
    np.testing.assert_allclose(runtime.last_logits(), plain.last_logits(), rtol=1e-4, atol=1e-4)
    bad = msgspec.structs.replace(settings, matmul_tiling=m.MatmulTiling(warps=3))
    with pytest.raises(LoadError, match="matmul_tiling: warps is 1, 2, 4, 8 or 16, not 3"):
        load_runtime("torch", folder, bad)
    cuBLAS = msgspec.structs.replace(settings, matmul="torch")
    with pytest.raises(LoadError, match='it needs matmul "triton"'):
        load_runtime("torch", folder, cuBLAS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_kernel_tracks_cublas_and_rows_stay_independent(dtype) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(4096, 4096, device="cuda", generator=generator).to(dtype) / 64
    x = torch.randn(MAX_ROWS, 4096, device="cuda", generator=generator).to(dtype)
    y = skinny_linear(x, weight)
    exact = x.double() @ weight.double().T
    tolerance = 1e-4 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(y.double(), exact, rtol=tolerance, atol=tolerance)
    for rows in (1, 2, 9):
        assert torch.equal(skinny_linear(x[:rows], weight), y[:rows]), rows


# ---------------------------------------------------------------- compiled ahead, for GPUs
# Triton compiles for a GPU without one: these tests build each kernel as a launch on that
# GPU would (the same arguments, specialized the same way), through PTX to the GPU's binary.
# Compute capability -> the most shared memory a program may take there, in bytes
GPUS = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # A100, RTX 30/40, H100
TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def compile_for(call: Launch, capability: int):
    """``call``'s kernel compiled for a CUDA GPU of ``capability`` (e.g. 90), specialized as
    Triton's JIT does at a launch: pointers and integers divisible by 16 are marked so."""
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    kernel = call.kernel
    signature, attrs = {}, {}
    for index, (name, value) in enumerate(zip(kernel.arg_names, call.args, strict=False)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]  # torch allocates 256-byte aligned
        else:
            signature[name] = "i32"
            if value % 16 == 0 and index not in kernel.do_not_specialize:
                attrs[(index,)] = [["tt.divisibility", 16]]
    constants = {k: v for k, v in call.constants.items() if k not in LAUNCH_OPTIONS}
    signature.update(dict.fromkeys(constants, "constexpr"))
    options = {k: v for k, v in call.constants.items() if k in LAUNCH_OPTIONS}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def gpu_launches(
    n: int, k: int, dtype: torch.dtype, capability: int, tiling: Tiling = DEFAULT_TILING
) -> list[Launch]:
    """The launches of a 16-row call on a GPU of ``capability`` (no memory: meta tensors)."""
    x = torch.empty(MAX_ROWS, k, dtype=dtype, device="meta")
    weight = torch.empty(n, k, dtype=dtype, device="meta")
    return launches(x, weight, None, tiling, shared=GPUS[capability])[1]


@pytest.mark.process  # triton runs ptxas
@pytest.mark.parametrize("capability", sorted(GPUS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernels_compile_for_each_gpu_within_its_shared_memory(capability, dtype) -> None:
    """The square layer (split, so both kernels) and a short one (one split, stored
    directly) compile; the weight's loads are pipelined (cp.async: a program asks for the
    next tiles while it multiplies) and the buffers fit the GPU. float32's tiles are twice
    the bytes: at 4 stages they would not fit an RTX 30/40 (99 KiB), so it gets fewer."""
    for n, k in ((4096, 4096), (96, 256)):
        calls = gpu_launches(n, k, dtype, capability)
        assert len(calls) == (2 if (n, k) == (4096, 4096) else 1)
        compiled = compile_for(calls[0], capability)
        assert 0 < compiled.metadata.shared <= GPUS[capability]
        assert "cp.async" in compiled.asm["ptx"]
        for call in calls[1:]:
            assert compile_for(call, capability).metadata.shared <= GPUS[capability]
    float32 = gpu_launches(4096, 4096, torch.float32, capability)[0].constants["num_stages"]
    assert float32 == (2 if GPUS[capability] < 128 * 1024 else 4)


@pytest.mark.process  # triton runs ptxas
def test_every_tiling_the_bench_times_compiles_for_an_h100() -> None:
    """bench_matmul times these on the GPU session's H100: none may fail there to compile."""
    n, k = HEAVY_1B[2][1:3]  # gate/up: the widest shape
    for label, tiling in TILINGS.items():
        for call in gpu_launches(n, k, torch.bfloat16, 90, tiling):
            assert compile_for(call, 90).metadata.shared <= GPUS[90], label


def test_a_tiling_is_checked_and_its_depth_fits_the_memory() -> None:
    with pytest.raises(ValueError, match="powers of two"):
        Tiling(block_n=48)
    with pytest.raises(ValueError, match="warps is"):
        Tiling(warps=3)
    with pytest.raises(ValueError, match="stages is"):
        Tiling(stages=0)
    with pytest.raises(ValueError, match="programs_per_sm"):
        Tiling(programs_per_sm=-1)
    # a stage holds 16 + 64 rows of 128 bfloat16 values: 20 KiB
    assert DEFAULT_TILING.stages_within(None, 2) == 4
    assert DEFAULT_TILING.stages_within(50 * 1024, 2) == 2
    assert DEFAULT_TILING.stages_within(10 * 1024, 2) == 1

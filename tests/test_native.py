"""The native CPU verifier: kernels against numpy, width invariance, and the runtime on a model.

Exactness is tested where it is promised: with block scales of 1 every product and sum is a
small integer, so the float result must equal numpy's int64 product exactly; with real scales
a row's result must not depend on the rows beside it nor on the thread count.
"""

from __future__ import annotations

import itertools
import os
import platform
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hetspec.native.kernels import (
    BEST,
    BLOCK,
    BLOCK_BYTES,
    F16,
    F32,
    IQ4_NL,
    IQ4_XS,
    PACKED_SIGNED,
    PACKED_UNSIGNED,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    SIMD_LEVELS,
    Kernels,
    NativeUnavailable,
    matrix,
)
from hetspec.native.model import NativeModel
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler, KeyedSampler
from hetspec.speculative.verify.tree import chain_parents
from hetspec.workers.runtimes.native_runtime import NativeRuntime
from hetspec.workers.runtimes.tree_runtime import RuntimeUsageError

MODELS = Path(__file__).resolve().parents[1] / "models"
TEXT = Path(textwrap.__file__).read_text()[:3000]
ROWS, COLS = 37, 3 * BLOCK  # odd on purpose: neither a multiple of the row tile nor of 16


@pytest.fixture(scope="module")
def kernels() -> Kernels:
    return Kernels.load()


def levels_here(kernels: Kernels, *, portable: bool = True) -> list[int]:
    """The kernel levels this CPU runs. The SIMD ones (AVX2, AVX-VNNI, AVX-512 VNNI) give the
    same bits; the portable C rounds its float steps its own way (no fused multiply-add, libm's
    expf)."""
    return [level for level in kernels.simd_levels() if portable or level > 0]


def quantized(kind: int, values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GGUF bytes (rows, row bytes) of integer ``values`` (rows, cols) with block ``scales``."""
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // BLOCK, BLOCK)
    if kind == Q8_0:
        record = np.zeros(blocks.shape[:2], [("d", "<f2"), ("qs", "i1", BLOCK)])
        record["qs"] = blocks
    else:  # Q4_0: element i in the low nibble of byte i, element i + 16 in the high one
        record = np.zeros(blocks.shape[:2], [("d", "<f2"), ("qs", "u1", BLOCK // 2)])
        nibbles = (blocks + 8).astype(np.uint8)
        record["qs"] = nibbles[..., : BLOCK // 2] | (nibbles[..., BLOCK // 2 :] << 4)
    record["d"] = scales
    return record.view(np.uint8).reshape(rows, -1).copy()


def integer_weights(
    kind: int, rng: np.random.Generator, rows: int = ROWS, cols: int = COLS
) -> np.ndarray:
    low, high = (-127, 128) if kind == Q8_0 else (-8, 8)
    return rng.integers(low, high, (rows, cols))


def unit_scale_rows(rng: np.random.Generator, n: int, cols: int = COLS) -> np.ndarray:
    """Integer rows whose every block quantizes with scale exactly 1 (its largest is 127)."""
    x = rng.integers(-127, 128, (n, cols)).astype(np.float32)
    x[:, ::BLOCK] = 127
    return x


def test_activations_quantize_per_row_block_as_the_reference(kernels: Kernels) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 4 * BLOCK)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
    x[2, :BLOCK] = 0  # an all-zero block: scale 0, values 0
    q, scale = kernels.quantize_rows(x)
    blocks = x.reshape(5, 4, BLOCK)
    expected_scale = np.abs(blocks).max(-1) / np.float32(127)
    inverse = np.where(expected_scale != 0, 1 / np.where(expected_scale != 0, expected_scale, 1), 0)
    scaled = blocks * inverse.astype(np.float32)[..., None]
    expected = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)  # C's roundf: half away from 0
    np.testing.assert_array_equal(scale, expected_scale)
    np.testing.assert_array_equal(q.reshape(5, 4, BLOCK), expected.astype(np.int8))


def test_activation_rounding_is_c_roundf_at_the_halves(kernels: Kernels) -> None:
    """Halves go away from zero, and the float just below a half goes down (a rounding by
    adding 0.5 would send 0.49999997 up): the SIMD path is C's roundf exactly."""
    below_half = np.nextafter(np.float32(0.5), np.float32(0))
    values = [127, 2.5, -2.5, 0.5, -0.5, below_half, -below_half, 126.5, -126.5, 1.5, 0]
    x = np.zeros((1, BLOCK), np.float32)
    x[0, : len(values)] = values  # the largest is 127: the scale is exactly 1
    q, scale = kernels.quantize_rows(x)
    assert scale[0, 0] == 1
    assert q[0, : len(values)].tolist() == [127, 3, -3, 1, -1, 0, 0, 127, -127, 2, 0]


@pytest.mark.parametrize("kind", [Q8_0, Q4_0])
def test_quantized_products_are_exact_integers_for_every_width(kernels, kind) -> None:
    rng = np.random.default_rng(kind)
    values = integer_weights(kind, rng)
    weights = matrix(kind, quantized(kind, values, np.ones((ROWS, COLS // BLOCK))), ROWS, COLS)
    for n in range(1, 33):
        x = unit_scale_rows(rng, n)
        expected = x.astype(np.int64) @ values.T
        for threads in (1, 2):
            for level in levels_here(kernels):
                np.testing.assert_array_equal(
                    kernels.matmul(weights, x, threads, level),
                    expected,
                    err_msg=f"{n} rows, kernel level {level}",
                )


@pytest.mark.parametrize("kind", [Q8_0, Q4_0, F16, F32])
def test_a_rows_result_does_not_depend_on_its_neighbours_or_threads(kernels, kind) -> None:
    rng = np.random.default_rng(7)
    rows, cols = 53, 8 * BLOCK
    if kind in (Q8_0, Q4_0):
        values = integer_weights(kind, rng, rows, cols)
        scales = rng.uniform(1e-3, 1e-2, (rows, cols // BLOCK))
        data = quantized(kind, values, scales)
        reference = (
            values.reshape(rows, -1, BLOCK) * scales.astype(np.float16)[..., None]
        ).reshape(rows, cols)
    else:
        dtype = np.float16 if kind == F16 else np.float32
        reference = rng.standard_normal((rows, cols)).astype(dtype)
        data = reference.view(np.uint8).reshape(rows, -1)
    weights = matrix(kind, data, rows, cols)
    x = rng.standard_normal((70, cols)).astype(np.float32)
    alone = np.concatenate(
        [kernels.matmul(weights, x[row : row + 1].copy(), threads=1) for row in range(len(x))]
    )
    # every way rows are split between the kernels: whole groups of 8, groups padded from 5-7
    # rows, features-in-lanes tiles of 1-4 rows, 16 features in lanes in passes of up to 32
    # rows (70: three passes of 24, 23, 23; 33: 17 and 16)
    packed = []  # Q8_0 copies packed with each kind of values (the levels read their own)
    for packing in (PACKED_UNSIGNED, PACKED_SIGNED) if kind == Q8_0 else ():
        copy = matrix(kind, data, rows, cols)
        copy.values = kernels.pack_q8_0(copy, packing)  # alive as long as the Matrix
        copy.packed, copy.packing = copy.values.ctypes.data, packing
        packed.append(copy)
    for n in (70, 33, 32, 24, 23, 17, 16, 15, 14, 13, 9, 8, 7, 6, 5, 4, 3, 2, 1):
        for level in levels_here(kernels, portable=False):  # every SIMD level: the same bits
            for which in (weights, *packed):
                together = kernels.matmul(which, x[:n].copy(), threads=2, simd=level)
                np.testing.assert_array_equal(
                    alone[:n], together, err_msg=f"{n} rows together, kernel level {level}"
                )
    exact = x.astype(np.float64) @ reference.astype(np.float64).T
    assert np.abs(alone - exact).max() <= 0.02 * np.abs(exact).max()  # int8 activations


def test_bad_weights_are_refused_with_a_reason() -> None:
    with pytest.raises(NativeUnavailable, match="not whole blocks"):
        matrix(Q8_0, np.zeros((2, 34), np.uint8), 2, 40)
    with pytest.raises(NativeUnavailable, match="contiguous bytes"):
        matrix(Q8_0, np.zeros((2, 30), np.uint8), 2, 32)
    with pytest.raises(NativeUnavailable, match="type 21"):  # IQ3_S
        matrix(21, np.zeros((2, 110), np.uint8), 2, 256)
    with pytest.raises(NativeUnavailable, match="not whole blocks of 256"):
        matrix(Q4_K, np.zeros((2, 144), np.uint8), 2, 128)


# ---------------------------------------------------------------- types read by unpacking

UNPACKED = {
    Q4_K: "Q4_K",
    Q5_K: "Q5_K",
    Q6_K: "Q6_K",
    Q5_0: "Q5_0",
    Q4_1: "Q4_1",
    Q5_1: "Q5_1",
    IQ4_NL: "IQ4_NL",
    IQ4_XS: "IQ4_XS",
}
SMALL_BLOCKS = (Q5_0, Q4_1, Q5_1, IQ4_NL)  # 32 values a block


def random_blocks(kind: int, rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random GGUF bytes of ``kind`` whose float scales (d, dmin) are small and finite."""
    values, size = BLOCK_BYTES[kind]
    data = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, (rows, cols // values, 2)).astype("<f2").view(np.uint8)
    if kind == Q6_K:  # d last
        data[..., -2:] = scales[..., :2]
    elif kind in (Q5_0, IQ4_NL):  # d first
        data[..., :2] = scales[..., :2]
    else:  # d, dmin (Q4_1, Q5_1: d, m; IQ4_XS: d, then any scale bits) first
        data[..., :4] = scales
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", UNPACKED, ids=UNPACKED.values())
def test_unpacked_types_dequantize_as_gguf_reads_them(kernels, kind) -> None:
    """gguf-py's numpy dequantizer is an independent reading of each format's layout."""
    import gguf  # noqa: PLC0415

    rng = np.random.default_rng(kind)
    rows, cols = 5, 3 * 256
    data = random_blocks(kind, rng, rows, cols)
    ours = kernels.dequantize(matrix(kind, data, rows, cols))
    theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(kind)).reshape(rows, cols)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    assert kernels.dequantize(matrix(kind, data, rows, cols), 2, 1).shape == (1, cols)
    with pytest.raises(ValueError, match="not rows"):
        kernels.dequantize(matrix(kind, data, rows, cols), 4, 2)


@pytest.mark.parametrize("kind", UNPACKED, ids=UNPACKED.values())
def test_unpacked_types_give_every_row_the_same_bits_at_every_level(kernels, kind) -> None:
    """One recipe for every kernel level (the portable C included), alone or among others;
    rows of 11 blocks of 32 (Q5_0, Q4_1, Q5_1) end in a short chunk."""
    rng = np.random.default_rng(100 + kind)
    rows, cols = 37, 11 * BLOCK if kind in SMALL_BLOCKS else 3 * 256
    weights = matrix(kind, random_blocks(kind, rng, rows, cols), rows, cols)
    x = rng.standard_normal((70, cols)).astype(np.float32)
    alone = np.concatenate(
        [
            kernels.matmul(weights, x[row : row + 1].copy(), threads=1, simd=0)
            for row in range(len(x))
        ]
    )
    # 12 and 13: Q4_1's last width 8 features at a time (two passes) and its first in groups
    for n in (70, 33, 24, 23, 17, 16, 15, 13, 12, 9, 8, 7, 6, 5, 4, 3, 2, 1):
        for level in levels_here(kernels):
            together = kernels.matmul(weights, x[:n].copy(), threads=2, simd=level)
            np.testing.assert_array_equal(
                alone[:n], together, err_msg=f"{n} rows together, kernel level {level}"
            )
    exact = x.astype(np.float64) @ kernels.dequantize(weights).astype(np.float64).T
    assert np.abs(alone - exact).max() <= 0.02 * np.abs(exact).max()  # int8 activations


# ---------------------------------------------------------------- the runtime on a model


@pytest.fixture(scope="module")
def native(heavy) -> NativeRuntime:
    return NativeRuntime(heavy.gguf("q8_0"), n_ctx=1024)


@pytest.mark.slow
def test_a_tokens_logits_are_bit_identical_alone_and_inside_a_tree(native) -> None:
    tokens = native.tokenize(TEXT)[:40]
    native.prefill(tokens[:20])
    chain = tokens[20:36]
    together = native.evaluate_tree(chain, chain_parents(16)).copy()
    native.discard_pending()
    for index, token in enumerate(chain):  # one token a call, each committed in turn
        alone = native.evaluate_tree([token], [-1])
        np.testing.assert_array_equal(alone[0], together[index])
        native.commit([0])
    # a branching tree: node 5 is chain[0], 5, 6 below the prefix
    native.rollback(20)
    tree = native.evaluate_tree([*chain[:4], 5, 6, 7], [-1, 0, 1, 2, 0, 4, 1]).copy()
    native.append([chain[0], 5])
    np.testing.assert_array_equal(native.evaluate_tree([6], [-1])[0], tree[5])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64's levels and cpuinfo flags")
def test_the_kernel_levels_here_are_the_cpus_extensions(kernels) -> None:
    """Each x86 level runs exactly where the CPU reports its extension (AVX-VNNI is read from
    CPUID apart from the others), and a cap runs the best level present at or below it."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE).group(1).split())
    expected = {SIMD_LEVELS["portable"]}
    if {"avx2", "fma", "f16c"} <= flags:
        expected.add(SIMD_LEVELS["avx2"])
        if "avx_vnni" in flags:
            expected.add(SIMD_LEVELS["avx_vnni"])
        if {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"} <= flags:
            expected.add(SIMD_LEVELS["vnni"])
    assert kernels.simd_levels() == sorted(expected)
    assert kernels.simd_level() == max(expected)
    for cap in SIMD_LEVELS.values():
        assert kernels.level_for(cap) == max(level for level in expected if level <= cap)


def test_every_kernel_level_gives_the_same_logits(heavy, native) -> None:
    """AVX-512 VNNI, AVX-VNNI (where the CPU has them) and AVX2 compute the same bits, so a
    verifier's output does not depend on which of them the box has."""
    tokens = native.tokenize(TEXT)[:30]
    levels = levels_here(native.model.kernels, portable=False)
    outputs = []
    for level in levels:
        name = next(name for name, value in SIMD_LEVELS.items() if value == level)
        runtime = NativeRuntime(heavy.gguf("q8_0"), n_ctx=64, simd=name)
        runtime.prefill(tokens[:20])
        outputs.append(runtime.evaluate_tree(tokens[20:30], chain_parents(10)).copy())
    for level, logits in zip(levels[1:], outputs[1:], strict=True):
        np.testing.assert_array_equal(logits, outputs[0], err_msg=f"kernel level {level}")


def test_a_greedy_chains_argmax_is_the_first_of_the_largest_at_every_level(kernels) -> None:
    """The vector argmax answers what the scalar loop does: the lowest index of the largest
    value (ties, -0 beside +0, the maximum in the tail or the first lanes), and where a row
    holds a NaN, whatever the portable level answers."""
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(n).astype(np.float32) for n in (1, 7, 8, 15, 16, 17, 4096, 4103)]
    tied = rng.integers(0, 4, 4096).astype(np.float32)  # many equal maxima
    zeros = np.zeros(40, np.float32)
    zeros[[3, 17]] = -0.0
    last = np.zeros(4103, np.float32)
    last[-1] = 1.0  # in the tail after the 8-lane blocks
    rows += [tied, zeros, last, np.full(64, -np.inf, np.float32)]
    for row in rows:
        for level in levels_here(kernels):
            assert kernels.argmax(row, level) == int(np.argmax(row)), (len(row), level)
    with_nan = rng.standard_normal(100).astype(np.float32)
    with_nan[[0, 50]] = np.nan
    answers = {kernels.argmax(with_nan, level) for level in levels_here(kernels)}
    assert len(answers) == 1


def test_a_small_models_packed_q8_0_copies_give_the_same_logits() -> None:
    """The bundled models are small enough for packed copies of their Q8_0 matrices (where
    the kernel level reads them): every width's logits, prefill's and a tree's, and a drafted
    chain are bit for bit those of the weights read in place."""
    kernels = Kernels.load()
    packs = kernels.level_for(BEST) >= SIMD_LEVELS.get("avx2", 99)
    simd = [None, *(["avx2"] if "avx2" in SIMD_LEVELS and kernels.level_for(BEST) > 1 else [])]
    for name, level in itertools.product(("draft", "target"), simd):
        path = MODELS / name / f"{name}-q8_0.gguf"
        assert NativeModel(path, capacity=8).packed == packs  # on its own where it reads them
        runs = []
        for pack in (True, False):  # at the best level, and AVX2's kind of packing below it
            runtime = NativeRuntime(path, n_ctx=256, threads=2, simd=level, pack=pack)
            assert runtime.model.packed == pack
            runtime.prefill(runtime.tokenize(TEXT)[:100])
            outputs = [runtime.last_logits().copy()]
            for width in (1, 2, 3, 4, 5, 8, 9, 16):
                outputs.append(
                    runtime.evaluate_tree(list(range(3, 3 + width)), chain_parents(width)).copy()
                )
            draft = runtime.draft(7, SamplingParams(), DrawnSampler(0))
            runs.append((outputs, draft.tokens.copy()))
        for ours, theirs in zip(runs[0][0], runs[1][0], strict=True):
            np.testing.assert_array_equal(ours, theirs)
        np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_prefill_in_chunks_gives_the_same_logits(native) -> None:
    tokens = native.tokenize(TEXT)[:300]
    native.rollback(0)
    native.prefill(tokens)
    whole = native.last_logits().copy()
    native.rollback(0)
    native.append(tokens, chunk_size=37)
    np.testing.assert_array_equal(native.last_logits(), whole)


@pytest.fixture(scope="module")
def k_quant_heavy(heavy):
    """heavy-100m in Q4_K_M (Q4_K and Q6_K tensors), quantized by llama.cpp."""
    from hetspec.models.heavy import ensure_heavy  # noqa: PLC0415

    return ensure_heavy("100m", ["q4_k_m"], heavy.folder.parent, quiet=True).gguf("q4_k_m")


@pytest.fixture(scope="module")
def k_quant_bundled(tmp_path_factory):
    """The bundled target in a K-quant or IQ4 mix: its FFN rows (704 values) are not whole
    super-blocks, so llama.cpp's Q4_K_M holds Q5_0 and Q8_0 tensors too, its Q5_K_M Q5_1, its
    IQ4_XS IQ4_NL."""
    from hetspec.models.llama_quantize import quantize_gguf  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("kquant")

    def made(quant_type: str) -> Path:
        out = folder / f"target-{quant_type}.gguf"
        if not out.exists():
            quantize_gguf(MODELS / "target" / "target-f16.gguf", out, quant_type, threads=1)
        return out

    return made


@pytest.mark.slow
@pytest.mark.parametrize(
    "gguf_type",
    ["q8_0", "q4_0", "q4_k_m", "bundled q4_k_m", "bundled q5_k_m", "bundled iq4_xs"],
)
def test_it_predicts_as_llama_cpp_does_on_the_same_file(request, heavy, gguf_type) -> None:
    from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415

    if gguf_type == "q4_k_m":
        path = request.getfixturevalue("k_quant_heavy")
    elif gguf_type.startswith("bundled "):
        path = request.getfixturevalue("k_quant_bundled")(gguf_type.split()[1])
    else:
        path = heavy.gguf(gguf_type)
    native = NativeRuntime(path, n_ctx=512)
    llama = LlamaCppRuntime(path, n_ctx=512, flash_attention="off", kv_type="f16", v_type="f32")
    tokens = native.tokenize(TEXT)[:257]
    assert tokens == llama.tokenize(TEXT)[:257]
    ours, theirs = (
        runtime.prefill(tokens[:1]) or runtime.evaluate_tree(tokens[1:], chain_parents(256))
        for runtime in (native, llama)
    )
    # both quantize activations to 8 bits (K-quants per 256 values, else per 32), but round
    # and order their float steps differently, and attention differs: close, not equal
    assert np.abs(ours - theirs).max() <= 0.05 * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.95


@pytest.mark.slow
def test_greedy_decoding_equals_greedy_verification(native) -> None:
    prompt = native.tokenize("def read_lines(path):\n")
    native.prefill(prompt)
    decoded = native.decode(24, SamplingParams(), DrawnSampler(0))
    native.prefill(prompt)
    logits = native.evaluate_tree(decoded, chain_parents(24))
    assert [int(native.last_logits().argmax()), *logits.argmax(-1)[:-1].tolist()] == decoded


def test_a_file_it_cannot_run_is_one_clear_error(tmp_path) -> None:
    with pytest.raises(NativeUnavailable, match="no such file"):
        NativeRuntime(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(NativeUnavailable, match=r"junk\.gguf"):
        NativeRuntime(junk)
    with pytest.raises(NativeUnavailable, match="threads"):
        NativeRuntime(MODELS / "target" / "target-q8_0.gguf", threads=1000)
    with pytest.raises(NativeUnavailable, match="context"):
        NativeRuntime(MODELS / "target" / "target-q8_0.gguf", n_ctx=10**6)


class StepwiseRuntime(NativeRuntime):
    """The same runtime drafting node by node, as every other runtime does."""

    _run_chain = None


def pending_state(runtime: NativeRuntime) -> list[np.ndarray]:
    return [
        runtime._pending_tokens,
        runtime._pending_parents,
        runtime._pending_depths,
        runtime._pending_mask,
    ]


def both_runtimes_through(heavy, stepwise_kind: type, scenario) -> list[tuple]:
    """What ``scenario(runtime)`` records on heavy-100m's runtime and on ``stepwise_kind``'s,
    each prefilled with the same prompt."""
    path = heavy.gguf("q8_0")
    runtimes = NativeRuntime(path, n_ctx=256), stepwise_kind(path, n_ctx=256)
    prompt = runtimes[0].tokenize(TEXT)[:40]
    records = []
    for runtime in runtimes:
        runtime.prefill(prompt)
        records.append(scenario(runtime))
    return records


def assert_same_drafts(ours: tuple, theirs: tuple, *, probs_rtol: float) -> None:
    """Two runtimes' records of the same calls: pending states (lists of arrays), logits and
    drafts equal, the drafts' probability rows within ``probs_rtol``."""
    for mine, other in zip(ours, theirs, strict=True):
        if isinstance(mine, list):
            for a, b in zip(mine, other, strict=True):
                np.testing.assert_array_equal(a, b)
        elif isinstance(mine, np.ndarray):
            np.testing.assert_array_equal(mine, other)
        else:
            np.testing.assert_array_equal(mine.tokens, other.tokens)
            np.testing.assert_array_equal(mine.nodes, other.nodes)
            assert mine.root == other.root
            np.testing.assert_allclose(mine.probs, other.probs, rtol=probs_rtol, atol=1e-9)


def test_a_greedy_chain_drafted_in_one_call_is_the_one_drafted_node_by_node(heavy) -> None:
    """The same tokens, probability rows, logits and pending tree: afresh, continued below a
    pending draft (``after``, as a drafter running ahead of verification does) and after a
    commit; only the calls into the kernels differ (one a chain instead of one a token)."""
    params = SamplingParams()

    def scenario(runtime: NativeRuntime) -> tuple:
        first = runtime.draft(9, params, DrawnSampler(0))
        state = [a.copy() for a in pending_state(runtime)]
        ahead = runtime.draft(5, params, DrawnSampler(0), after=(7, int(first.tokens[0, 8])))
        ahead_state = [a.copy() for a in pending_state(runtime)]
        runtime.commit([0, 1, 2])  # the logits after node 2 come from the chain's output
        logits = runtime.last_logits().copy()
        third = runtime.draft(4, params, DrawnSampler(0))
        return first, state, ahead, ahead_state, logits, third, pending_state(runtime)

    drafts = both_runtimes_through(heavy, StepwiseRuntime, scenario)
    assert_same_drafts(*drafts, probs_rtol=1e-6)
    assert len(set(drafts[0][0].tokens[0].tolist())) > 1  # a real chain, not one token


class CountingRuntime(NativeRuntime):
    """Counts its chains drafted in one call."""

    chains = 0

    def _run_chain(self, *args, **kwargs):
        self.chains += 1
        return super()._run_chain(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [True, False], ids=["keyed", "drawn"])
def test_a_sampled_chain_drafted_in_one_call_is_the_one_drafted_node_by_node(
    heavy, seeded: bool
) -> None:
    """Sampled at a temperature alone, a chain is one call too, choosing from rows equal to
    the node-by-node draft's (to float rounding: the kernels' softmax) with the same sampler:
    a seeded request's keyed choices (argmax p / the position's noise), an unseeded one's
    draws (a uniform a token, from the same generator); so the same tokens and pending tree,
    afresh and continued."""
    path, params = heavy.gguf("q8_0"), SamplingParams(temperature=0.8)
    sampler = (lambda: KeyedSampler(7)) if seeded else (lambda: DrawnSampler(7))
    chained, stepwise = CountingRuntime(path, n_ctx=256), StepwiseRuntime(path, n_ctx=256)
    prompt = chained.tokenize(TEXT)[:40]
    drafts = []
    for runtime in (chained, stepwise):
        runtime.prefill(prompt)
        first = runtime.draft(9, params, sampler())
        ahead = runtime.draft(5, params, sampler(), after=(7, int(first.tokens[0, 8])))
        drafts.append((first, ahead, [a.copy() for a in pending_state(runtime)]))
    assert chained.chains == 2
    for ours, theirs in zip(drafts[0][:2], drafts[1][:2], strict=True):
        np.testing.assert_array_equal(ours.tokens, theirs.tokens)
        np.testing.assert_array_equal(ours.nodes, theirs.nodes)
        np.testing.assert_allclose(ours.probs, theirs.probs, rtol=1e-5, atol=1e-8)
    for a, b in zip(drafts[0][2], drafts[1][2], strict=True):
        np.testing.assert_array_equal(a, b)
    first = drafts[0][0]
    assert len(set(first.tokens[0].tolist())) > 1
    if seeded:  # each token the keyed choice of the row reported with it
        noise = KeyedSampler(7).chain_draws(len(prompt), 9, chained.vocab_size).noise
        np.testing.assert_array_equal(first.tokens[0], (first.probs[0] / noise).argmax(-1))
    # top-k and top-p truncate the rows, which the race does not: node by node
    chained.discard_pending()
    chained.draft(4, SamplingParams(temperature=0.8, top_p=0.9), KeyedSampler(7))
    assert chained.chains == 2


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [None, True], ids=["greedy", "keyed"])
def test_a_draft_evaluating_its_appended_token_in_the_chain_call_is_append_then_draft(
    heavy, seeded: bool | None
) -> None:
    """Rounds as the daemon runs them (the accepted path and the bonus appended, then a draft):
    ``catch_up`` and ``draft(first=...)`` give the tokens, rows, pending tree, committed
    sequence and next-token logits of ``append`` then ``draft`` node by node, in one kernel
    call a draft (the appended token's forward the chain's first), and count each forward:
    gamma tokens, gamma forwards, where the append's last new token is evaluated."""
    path = heavy.gguf("q8_0")
    params = SamplingParams(temperature=0.8) if seeded else SamplingParams()
    sampler = (lambda: KeyedSampler(7)) if seeded else (lambda: DrawnSampler(0))
    fused, stepwise, fallback = (
        CountingRuntime(path, n_ctx=256),
        StepwiseRuntime(path, n_ctx=256),
        StepwiseRuntime(path, n_ctx=256),
    )
    prompt = fused.tokenize(TEXT)[:40]
    # accepted tokens of each round's draft of 6, then the bonus: none, two, all six (whose
    # last was drawn, not evaluated: two new tokens), one; a bonus other than the draft's
    accepted = [0, 2, 6, 1]
    rounds = {}
    for name, runtime in (("fused", fused), ("stepwise", stepwise), ("fallback", fallback)):
        runtime.prefill(prompt)
        draft = runtime.draft(6, params, sampler())
        seen = []
        for count in accepted:
            drafted = draft.tokens[0].tolist()
            bonus = next(t for t in (5, 6) if count == 6 or t != drafted[count])
            tokens = [*drafted[:count], bonus]
            before = runtime.forwards
            if name == "stepwise":
                runtime.append(tokens)
                draft = runtime.draft(6, params, sampler())
            else:
                first = runtime.catch_up(tokens)
                assert first == tokens[-1]  # the bonus is never a pending node here
                caught_up = runtime.forwards
                draft = runtime.draft(6, params, sampler(), first=first)
                assert runtime.forwards - caught_up == 6
                assert caught_up - before == (count == 6)  # the drawn last token's forward
            seen.append(
                (
                    draft,
                    [a.copy() for a in pending_state(runtime)],
                    list(runtime.tokens),
                    runtime.last_logits().copy(),
                )
            )
        rounds[name] = seen
    assert fused.chains == 1 + len(accepted)
    for name in ("fused", "fallback"):
        for (ours, state, committed, logits), (
            theirs,
            their_state,
            their_committed,
            their_logits,
        ) in zip(rounds[name], rounds["stepwise"], strict=True):
            np.testing.assert_array_equal(ours.tokens, theirs.tokens)
            np.testing.assert_array_equal(ours.nodes, theirs.nodes)
            assert ours.root == theirs.root
            np.testing.assert_allclose(ours.probs, theirs.probs, rtol=1e-5, atol=1e-8)
            for a, b in zip(state, their_state, strict=True):
                np.testing.assert_array_equal(a, b)
            assert committed == their_committed
            np.testing.assert_array_equal(logits, their_logits)
    assert len(set(rounds["fused"][-1][0].tokens[0].tolist())) > 1
    # a bonus that is a pending node: nothing left to evaluate, the draft starts from its row
    runtime = fused
    runtime.discard_pending()
    runtime.forward_tree([11, 12], [-1, 0])
    assert runtime.catch_up([11, 12]) is None
    assert runtime.tokens[-2:] == [11, 12]
    assert runtime.pending == 0


@pytest.mark.slow
def test_a_drawn_chain_token_follows_the_row_it_reports() -> None:
    """Unseeded, each chained token is a draw from the probability row reported with it
    (chi-square over 3000 chains from one state)."""
    from laws import chi2_critical, chi_square  # noqa: PLC0415

    runtime = NativeRuntime(MODELS / "draft" / "draft-q8_0.gguf", n_ctx=256)
    runtime.prefill(runtime.tokenize(TEXT)[:40])
    counts: dict[int, int] = {}
    row = None
    trials = 3000
    for trial in range(trials):
        draws = DrawnSampler(trial).chain_draws(40, 1, runtime.vocab_size)
        tokens, _, probs = runtime._chain(17, -1, 1, draws, 1.5)
        runtime.discard_pending()
        if row is None:
            row = probs[0].copy()
        np.testing.assert_array_equal(probs[0], row)  # the same state: the same row
        counts[int(tokens[1])] = counts.get(int(tokens[1]), 0) + 1
    assert abs(float(row.sum()) - 1) < 1e-5
    law = {token: float(p) for token, p in enumerate(row) if p > 0}
    statistic, df = chi_square(counts, law, trials)
    assert df >= 5, df  # a spread row, not one token
    assert statistic < chi2_critical(df), (statistic, df)


def test_a_greedy_chain_past_the_context_is_refused(heavy) -> None:
    runtime = NativeRuntime(heavy.gguf("q8_0"), n_ctx=32)
    runtime.prefill(runtime.tokenize(TEXT)[:28])
    with pytest.raises(RuntimeUsageError, match="context full"):
        runtime.draft(8, SamplingParams(), DrawnSampler(0))
    assert runtime.pending == 0


def test_bench_draft_times_a_round_s_draft_call_against_a_forward_alone(capsys) -> None:
    """The micro-benchmark behind docs/bench/native/draft-calls.md runs on the bundled draft
    and says, per runtime and gamma, what a draft token costs in rounds and alone."""
    from hetspec.bench import draft_cost as bench_draft  # noqa: PLC0415

    draft = str(MODELS / "draft" / "draft-q8_0.gguf")
    cores = os.sched_getaffinity(0)
    try:  # --cores pins this process, as a worker pins itself
        assert (
            bench_draft.main(
                [
                    draft,
                    "--runtimes",
                    "native",
                    "--gammas",
                    "3",
                    "--rounds",
                    "5",
                    "--prefix",
                    "16",
                    "--cores",
                    "0",
                ]
            )
            == 0
        )
    finally:
        os.sched_setaffinity(0, cores)
    lines = capsys.readouterr().out.splitlines()
    assert "16 tokens of context" in lines[0]
    (line,) = lines[1:]
    assert line.startswith("  cpu (native, ")
    figures = [float(x) for x in re.findall(r"\d+\.\d", line.split("gamma 3:")[1])]
    assert len(figures) == 3
    assert all(figure > 0 for figure in figures)


class BranchesStepwiseRuntime(NativeRuntime):
    """The same runtime drafting branches one forward of all their rows at a time."""

    _run_branches = None


@pytest.mark.slow
@pytest.mark.parametrize("branches", [2, 4])
def test_greedy_branches_drafted_in_one_call_are_the_ones_drafted_step_by_step(
    heavy, branches: int
) -> None:
    """The same tokens, nodes, pending tree and logits, and probability rows within float
    rounding: afresh, continued below a pending node (``after``) and after committing a
    branch's path; only the calls into the kernels differ (one a draft instead of one a step)."""
    params = SamplingParams()

    def scenario(runtime: NativeRuntime) -> tuple:
        first = runtime.draft(6, params, DrawnSampler(0), branches=branches)
        state = [a.copy() for a in pending_state(runtime)]
        after = (int(first.nodes[1, 2]), int(first.tokens[1, 3]))
        below = runtime.draft(4, params, DrawnSampler(0), branches=branches, after=after)
        below_state = [a.copy() for a in pending_state(runtime)]
        runtime.commit([int(node) for node in first.nodes[1, :3]])
        logits = runtime.last_logits().copy()
        third = runtime.draft(5, params, DrawnSampler(0), branches=branches)
        return first, state, below, below_state, logits, third, pending_state(runtime)

    drafts = both_runtimes_through(heavy, BranchesStepwiseRuntime, scenario)
    assert_same_drafts(*drafts, probs_rtol=1e-5)
    tokens = drafts[0][0].tokens
    assert len(set(tokens[:, 1].tolist())) > 1  # the branches went their own ways

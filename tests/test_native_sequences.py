"""Several sequences in one native forward (issue #72's first stage): each sequence owns a range
of the KV cache, and a row computed beside other sequences' rows has bit for bit the logits,
keys and values it has in a call of its own. That is what makes a request's output independent
of the load, so it is tested hard: random layouts of sequences in the cache, committed lengths,
pending trees and new trees of mixed widths, at every kernel level here and on every weight
type the native tests cover, windowed and soft-capped models included.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
import pytest

from hetspec.native.kernels import BEST, SIMD_LEVELS, Kernels
from hetspec.native.model import ModelFormatError, NativeModel, SequenceRows
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler, KeyedSampler
from hetspec.workers.runtimes.native_runtime import NativeRuntime
from hetspec.workers.runtimes.native_sequences import (
    Chunk,
    NativeSequence,
    NativeSequences,
    SlotRanges,
    Tree,
)
from hetspec.workers.runtimes.tree_runtime import RuntimeUsageError

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGET = MODELS / "target"
LEVELS = Kernels.load().simd_levels()
LEVEL_NAMES = {value: name for name, value in SIMD_LEVELS.items()}


# ---------------------------------------------------------------- random layouts


def random_parents(rng: np.random.Generator, count: int, before: int) -> list[int]:
    """Parents of ``count`` nodes after ``before`` existing ones: -1 (the committed end) or an
    earlier node, often the one just before (chains), sometimes any (branches)."""
    parents = []
    for index in range(before, before + count):
        if index == 0 or rng.random() < 0.15:
            parents.append(-1)
        elif rng.random() < 0.6:
            parents.append(index - 1)
        else:
            parents.append(int(rng.integers(0, index)))
    return parents


@functools.cache
def node_paths(parents: tuple[int, ...]) -> list[list[int]]:
    """Each node's ancestors and itself, root first."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        paths.append([*(paths[parent] if parent >= 0 else []), node])
    return paths


class Layout:
    """One sequence in slots base..base+context-1: ``committed`` tokens, then the nodes of
    ``parents`` (pending ones first, then the new ones, evaluated in one forward)."""

    def __init__(self, rng, model: NativeModel, base: int, context: int, committed: int) -> None:
        self.base = base
        room = context - 1
        self.committed = min(committed, room)
        self.pending = int(rng.integers(0, min(room - self.committed, 8) + 1))
        widest = min(room + 1 - self.committed - self.pending, 17)
        self.new = int(rng.choice([1, 1, 2, 5, 8, 9, 16, 17, widest]).clip(1, widest))
        self.parents = tuple(random_parents(rng, self.pending + self.new, 0))
        self.tokens = rng.integers(0, model.vocab, self.committed + self.pending + self.new)
        self.first_logit = int(rng.choice([0, 0, self.new - 1, self.new]))

    def rows(self, first: int, count: int, first_logit: int = 0) -> SequenceRows:
        """Nodes first..first+count-1 (of the pending and new ones) as the kernels take them."""
        paths = node_paths(self.parents)[first : first + count]
        after = self.base + self.committed  # the first pending slot
        offsets = np.cumsum([0, *(len(path) for path in paths)])
        return SequenceRows(
            self.tokens[self.committed + first : self.committed + first + count],
            np.array([self.committed + len(path) - 1 for path in paths]),
            self.base,
            self.committed,
            after + first,
            offsets,
            np.concatenate([after + np.asarray(path) for path in paths]),
            first_logit,
        )

    def prepare(self, model: NativeModel) -> None:
        """Its committed tokens and pending nodes into the cache, in calls of their own."""
        if self.committed:
            count = self.committed
            model.forward(
                self.tokens[:count],
                np.arange(count),
                start=self.base,
                prefix=0,
                offsets=np.cumsum([0, *range(1, count + 1)]),
                visible=np.concatenate([self.base + np.arange(i + 1) for i in range(count)]),
                first_logit=count - 1,
                threads=2,
                prefix_start=self.base,
            )
        if self.pending:
            self.forward_on_its_own(model, self.rows(0, self.pending))

    @staticmethod
    def forward_on_its_own(model: NativeModel, rows: SequenceRows) -> np.ndarray:
        return model.forward(
            rows.tokens,
            rows.positions,
            start=rows.start,
            prefix=rows.prefix,
            offsets=rows.offsets,
            visible=rows.visible,
            first_logit=rows.first_logit,
            threads=2,
            prefix_start=rows.prefix_start,
        )

    def new_rows(self) -> SequenceRows:
        return self.rows(self.pending, self.new, self.first_logit)

    def new_slots(self) -> slice:
        first = self.base + self.committed + self.pending
        return slice(first, first + self.new)


def random_layouts(rng, model: NativeModel, count: int) -> list[Layout]:
    """``count`` sequences in disjoint ranges of the cache, in a random order, with gaps; in
    half the layouts all as long as they may be up to one length (rows of different sequences
    with prefixes of one length, which attention must still tell apart)."""
    capacity = model.capacity
    contexts = rng.integers(8, capacity // count + 1, count)
    spare = capacity - int(contexts.sum())
    gaps = rng.multinomial(spare, np.ones(count + 1) / (count + 1))
    if rng.random() < 0.5:
        gaps[0] = 0  # slot 0 on: the old single-sequence entry point computes it
    common = int(rng.integers(0, 91)) if rng.random() < 0.5 else None
    layouts, base = [], 0
    for context, gap in zip(contexts, gaps, strict=False):
        base += int(gap)
        committed = int(rng.integers(0, 91)) if common is None else common
        layouts.append(Layout(rng, model, base, int(context), committed))
        base += int(context)
    return [layouts[i] for i in rng.permutation(count)]


@functools.cache
def model_of(path: Path, level: int) -> NativeModel:
    return NativeModel(path, capacity=256, simd=level)


def at_slot_0(path: Path, level: int, layout: Layout) -> np.ndarray:
    """The new rows' logits of ``layout`` moved to slot 0 of another model's cache (the old
    single-sequence call): where a sequence sits in the cache changes none of its bits."""
    moved = copy.copy(layout)
    moved.base = 0
    model = model_of(path, level)
    moved.prepare(model)
    return Layout.forward_on_its_own(model, moved.new_rows())


def check_together_is_on_its_own(
    model: NativeModel, rng: np.random.Generator, trials: int, level: int = BEST
) -> None:
    """Random layouts: each sequence's new rows computed on their own, then all sequences' in one
    forward (in a random order): the same logits and the same keys and values, bit for bit;
    and on their own, the same logits as the sequence at slot 0 of another cache."""
    for trial in range(trials):
        layouts = random_layouts(rng, model, int(rng.integers(1, 7)))
        for layout in layouts:
            layout.prepare(model)
        own, written = [], []
        for layout in layouts:
            own.append(Layout.forward_on_its_own(model, layout.new_rows()).copy())
            np.testing.assert_array_equal(at_slot_0(model.path, level, layout), own[-1])
            slots = layout.new_slots()
            written.append((model.keys[:, :, slots].copy(), model.values[:, :, slots].copy()))
            model.keys[:, :, slots] = model.values[:, :, slots] = np.nan  # must be rewritten
        together = model.forward_sequences([layout.new_rows() for layout in layouts], threads=2)
        for index, layout in enumerate(layouts):
            message = f"trial {trial}, sequence {index} of {len(layouts)}"
            np.testing.assert_array_equal(together[index], own[index], err_msg=message)
            assert together[index].shape == (layout.new - layout.first_logit, model.vocab)
            keys, values = written[index]
            np.testing.assert_array_equal(model.keys[:, :, layout.new_slots()], keys, message)
            np.testing.assert_array_equal(model.values[:, :, layout.new_slots()], values, message)


# ---------------------------------------------------------------- the kernels


@pytest.mark.parametrize("level", LEVELS, ids=[LEVEL_NAMES[level] for level in LEVELS])
def test_sequences_in_one_forward_are_their_rows_on_their_own_on_the_bundled_target(level) -> None:
    model = NativeModel(TARGET / "target-q8_0.gguf", capacity=640, simd=level)
    check_together_is_on_its_own(model, np.random.default_rng(level + 1), 12, level)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
def test_sequences_in_one_forward_are_their_rows_on_their_own_on_heavy_100m(heavy, kind) -> None:
    """A 1024-wide model with 16 query heads over 4 KV heads: attention's sets of 16 rows
    and its widened key blocks, with prefixes past one block of 32 keys. (The portable
    level's F16 products are slow: its attention is checked on the bundled target.)"""
    model = NativeModel(heavy.gguf(kind), capacity=512)
    check_together_is_on_its_own(model, np.random.default_rng(len(kind)), 3)


@pytest.fixture(scope="module")
def k_quant_target(tmp_path_factory):
    """The bundled target in llama.cpp's K-quant and IQ4 mixes (test_native's types: Q4_K,
    Q5_K, Q6_K, Q5_0, Q5_1, Q8_0, IQ4_XS, IQ4_NL between them)."""
    from hetspec.models.llama_quantize import quantize_gguf  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("kquant")

    @functools.cache
    def made(quant_type: str) -> Path:
        out = folder / f"target-{quant_type}.gguf"
        quantize_gguf(TARGET / "target-f16.gguf", out, quant_type, threads=1)
        return out

    return made


@pytest.mark.slow
@pytest.mark.parametrize("quant_type", ["q4_k_m", "q5_k_m", "iq4_xs"])
def test_sequences_in_one_forward_are_their_rows_on_their_own_on_k_quants(
    k_quant_target, quant_type
):
    for level in LEVELS:
        model = NativeModel(k_quant_target(quant_type), capacity=512, simd=level)
        check_together_is_on_its_own(model, np.random.default_rng(level), 3, level)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """Tiny Gemma 2 and Gemma 3 files: sliding windows of 6 positions on some layers (a
    row's window starts inside its own sequence's prefix or its tree), Gemma 2's soft caps."""
    from tiny_models import write_tiny_gguf  # noqa: PLC0415

    @functools.cache
    def export(name: str) -> Path:
        folder = tmp_path_factory.mktemp(name)
        return write_tiny_gguf(folder, name, gguf_type="q8_0", context=256, intermediate_size=128)

    return export


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_windowed_sequences_in_one_forward_are_their_rows_on_their_own(windowed, name) -> None:
    for level in LEVELS:
        model = NativeModel(windowed(name), capacity=256, simd=level)
        check_together_is_on_its_own(model, np.random.default_rng(level), 6, level)


def test_one_sequence_at_slot_0_is_the_old_single_sequence_call() -> None:
    """hs_forward is the one-sequence case: the same rows through either entry point."""
    model = NativeModel(TARGET / "target-q8_0.gguf", capacity=128)
    rng = np.random.default_rng(5)
    layout = Layout(rng, model, 0, 128, 40)
    layout.prepare(model)
    rows = layout.rows(layout.pending, layout.new)
    old = model.forward(
        rows.tokens,
        rows.positions,
        start=rows.start,
        prefix=rows.prefix,
        offsets=rows.offsets,
        visible=rows.visible,
        first_logit=0,
        threads=1,
    ).copy()
    np.testing.assert_array_equal(model.forward_sequences([rows], threads=1)[0], old)


def test_a_forward_that_would_mix_sequences_is_refused() -> None:
    """A sequence's rows never read or write another's slots: spans that overlap, a visible
    slot outside the row's own sequence, a prefix running into the new rows are refused."""
    model = NativeModel(TARGET / "target-q8_0.gguf", capacity=64)

    def rows(base, prefix, start, visible, count=1):
        return SequenceRows(
            np.zeros(count, np.int32),
            np.arange(prefix, prefix + count),
            base,
            prefix,
            start,
            np.arange(count + 1) * (len(visible) // count),
            np.asarray(visible),
        )

    fine = [rows(0, 4, 4, [4]), rows(10, 4, 14, [14])]
    assert [len(out) for out in model.forward_sequences(fine, threads=1)] == [1, 1]
    refused = [
        [rows(0, 4, 4, [4]), rows(3, 1, 4, [4])],  # the second's prefix holds the first's row
        [rows(0, 4, 4, [4]), rows(4, 0, 4, [4])],  # both write slot 4
        [rows(0, 4, 4, [4]), rows(10, 4, 14, [4])],  # sees the other sequence's slot
        [rows(0, 4, 4, [3])],  # a visible slot inside its own prefix
        [rows(0, 4, 4, [5])],  # a visible slot after its own
        [rows(0, 5, 4, [4])],  # prefix past the first new slot
        [rows(2**31 - 1, 10, 4, [4])],  # a prefix whose end would wrap around
        [rows(60, 2, 62, [62, 63, 64, 65], count=4)],  # past the cache
    ]
    backwards = SequenceRows(  # offsets that decrease: refused before a slot is read
        np.zeros(2, np.int32), np.array([4, 5]), 0, 4, 4, np.array([0, 2, 1]), np.array([4, 5])
    )
    refused.append([backwards])
    for sequences in refused:
        with pytest.raises(ValueError, match=r"refused|must"):
            model.forward_sequences(sequences, threads=1)
    with pytest.raises(ValueError, match="at least one"):
        model.forward_sequences([], threads=1)


# ---------------------------------------------------------------- the runtime


def test_slot_ranges_hand_out_disjoint_ranges_and_merge_what_comes_back() -> None:
    """Random allocations and releases against a slot-by-slot account: ranges never overlap,
    a request is refused exactly when no free run is long enough, and freed neighbours merge
    (everything given back is one free range again)."""
    capacity = 300
    ranges, taken = SlotRanges(capacity), {}
    used = np.zeros(capacity, bool)
    rng = np.random.default_rng(11)

    def longest_free() -> int:
        runs = np.diff(np.flatnonzero(np.diff(np.concatenate([[1], used, [1]]).astype(int))))
        return int(runs[::2].max()) if len(runs) else 0

    for _ in range(600):
        if taken and rng.random() < 0.45:
            start = int(rng.choice(list(taken)))
            ranges.release(start, taken[start])
            used[start : start + taken.pop(start)] = False
        else:
            size = int(rng.integers(1, 80))
            if longest_free() < size:
                with pytest.raises(RuntimeUsageError, match="free slots"):
                    ranges.allocate(size)
                continue
            start = ranges.allocate(size)
            assert not used[start : start + size].any()
            assert start + size <= capacity
            used[start : start + size] = True
            taken[start] = size
        assert ranges.free == capacity - used.sum()
        assert ranges.longest == longest_free()
    for start, size in taken.items():
        ranges.release(start, size)
    assert (ranges.free, ranges.longest) == (capacity, capacity)
    start = ranges.allocate(10)
    with pytest.raises(RuntimeUsageError, match="not taken"):
        ranges.release(start, 11)  # more than was taken
    ranges.release(start, 10)
    with pytest.raises(RuntimeUsageError, match="not taken"):
        ranges.release(start, 10)  # twice


def greedy_verdict(tokens: list[int], parents: list[int], logits: np.ndarray) -> list[int]:
    """The accepted path of a greedy verification: from node 0 (the last round's bonus), the
    child holding each node's argmax, as long as there is one."""
    path = [0]
    while True:
        wanted = int(logits[path[-1]].argmax())
        child = next(
            (n for n, p in enumerate(parents) if p == path[-1] and tokens[n] == wanted), None
        )
        if child is None:
            return path
        path.append(child)


class Request:
    """A request of the batch test: its prompt, the tokens it decodes on its own (``steps``) and,
    once started, its sequence, the tokens drawn so far (the last one the bonus, not committed
    yet) and how much of its prompt is committed."""

    def __init__(self, prompt: list[int], decoded: list[int]) -> None:
        self.prompt, self.decoded = prompt, decoded
        self.context = len(prompt) + len(decoded) + 8
        self.sequence: NativeSequence | None = None
        self.drawn: list[int] = []
        self.prefilled = 0

    def start(self, batch: NativeSequences, rng: np.random.Generator) -> None:
        """Open its sequence; prefill it on its own, or leave the prompt to chunks beside others."""
        self.sequence = batch.open(self.context)
        if rng.random() < 0.5:
            self.sequence.prefill(self.prompt)
            self.prefilled = len(self.prompt)
            self.drawn.append(int(self.sequence.last_logits().argmax()))

    def work(self, rng: np.random.Generator, vocab: int) -> Tree | Chunk:
        """A chunk of its prompt, or a tree: the bonus and a random draft below it (chains
        and branches, 70% of its tokens the right ones)."""
        if self.prefilled < len(self.prompt):
            size = int(rng.integers(1, 40))
            return Chunk(self.sequence, self.prompt[self.prefilled : self.prefilled + size])
        tokens, parents = [self.drawn[-1]], [-1]
        for _ in range(int(rng.integers(0, 6))):
            at = len(self.drawn) - 1 + len(tokens)
            right = self.decoded[at] if at < len(self.decoded) else 0
            tokens.append(right if rng.random() < 0.7 else int(rng.integers(0, vocab)))
            chained = rng.random() < 0.8
            parents.append(len(tokens) - 2 if chained else int(rng.integers(0, len(tokens) - 1)))
        return Tree(self.sequence, tokens, parents)

    def take(self, item: Tree | Chunk, logits: np.ndarray) -> bool:
        """Apply what the forward gave ``item``; whether the request has all its tokens."""
        if isinstance(item, Chunk):
            assert logits.shape == (self.sequence.vocab_size,)
            self.prefilled += len(item.tokens)
            if self.prefilled == len(self.prompt):
                self.drawn.append(int(logits.argmax()))
            return False
        path = greedy_verdict(list(item.tokens), list(item.parents), logits)
        self.sequence.commit(path)
        self.drawn += [item.tokens[node] for node in path[1:]]
        self.drawn.append(int(logits[path[-1]].argmax()))
        return len(self.drawn) >= len(self.decoded)


def test_sequences_verified_together_decode_what_each_decodes_on_its_own() -> None:
    """Requests joining and leaving: prompts prefilled on their own or as chunks beside the others'
    rounds, greedy rounds of random drafts verified in one forward, a finished sequence's
    slots reused by the next: every request's tokens are those it decodes on its own, and
    a round's rows are those its sequence evaluates on its own."""
    path = TARGET / "target-q8_0.gguf"
    batch = NativeSequences.load(path, 700, threads=2)
    rng = np.random.default_rng(23)
    single = NativeRuntime(path, n_ctx=256, threads=2)
    waiting = []
    for _ in range(7):
        prompt = rng.integers(0, single.vocab_size, int(rng.integers(1, 120))).tolist()
        single.prefill(prompt)
        waiting.append(Request(prompt, single.decode(24, SamplingParams(), DrawnSampler(0))))
    active: list[Request] = []
    checked_own = 0
    while waiting or active:
        while waiting and batch.slots.longest >= waiting[0].context and len(active) < 4:
            active.append(waiting.pop(0))
            active[-1].start(batch, rng)
        work = {
            id(item): (request, item)
            for request in active
            for item in [request.work(rng, single.vocab_size)]
        }
        items = [item for _, item in work.values()]
        rng.shuffle(items)
        trees = [item for item in items if isinstance(item, Tree)]
        own = None
        if trees and rng.random() < 0.5:  # one tree on its own first: the same rows together
            own_tree = trees[int(rng.integers(0, len(trees)))]
            own = own_tree.sequence.evaluate_tree(own_tree.tokens, own_tree.parents).copy()
        for item, logits in zip(items, batch.evaluate(items), strict=True):
            request = work[id(item)][0]
            if own is not None and item is own_tree:
                np.testing.assert_array_equal(logits, own)
                checked_own += 1
            if request.take(item, logits):
                assert request.drawn[: len(request.decoded)] == request.decoded
                batch.close(request.sequence)
                active.remove(request)
    assert checked_own > 3
    assert batch.slots.free == batch.model.capacity
    assert not batch.sequences


def test_what_a_batch_cannot_do_is_refused_and_changes_nothing() -> None:
    path = TARGET / "target-q8_0.gguf"
    batch = NativeSequences.load(path, 100, threads=1)
    first, second = batch.open(40), batch.open(40)
    with pytest.raises(RuntimeUsageError, match="free slots"):
        batch.open(21)  # 20 left
    first.prefill([1, 2, 3])
    second.prefill([4, 5])
    first.forward_tree([6, 7], [-1, 0])
    before = first.last_logits().copy()
    other = NativeSequences.load(path, 50, threads=1).open(10)
    for work, match in [
        ([], "nothing"),
        ([Tree(first, [1], [-1]), Tree(first, [2], [-1])], "at most one"),
        ([Tree(second, [1], [-1]), Tree(other, [1], [-1])], "not open here"),
        ([Tree(second, [1] * 39, list(range(-1, 38)))], "context full"),
        ([Chunk(second, [])], "at least one"),
        ([Tree(second, [1], [3])], "parent must be"),  # a TreeError, as forward_tree's
    ]:
        with pytest.raises(ValueError, match=match):
            batch.evaluate(work)
    assert first.pending == 2  # refused before its plan: its pending tree stands
    assert (first.tokens, second.tokens) == ([1, 2, 3], [4, 5])
    np.testing.assert_array_equal(first.last_logits(), before)
    batch.close(second)
    with pytest.raises(RuntimeUsageError, match="not open here"):
        batch.close(second)
    with pytest.raises(RuntimeUsageError, match="not open here"):
        batch.evaluate([Tree(second, [1], [-1])])
    with pytest.raises(RuntimeUsageError, match="closed"):
        second.prefill([1, 2])  # its old slots may be another sequence's now
    assert batch.slots.free == 60


def test_the_bench_times_k_sequences_in_one_forward_against_k_forwards(capsys) -> None:
    """bench/batched_verify.py (docs/bench/batched-verify.md) on the bundled target: a row for
    every k and w, the rows together and on their own checked to be the same bits as it times them,
    and a model it cannot find skipped with its reason."""
    from hetspec.bench import batched_verify  # noqa: PLC0415

    argv = ["--models", "bundled,nowhere.gguf", "--sequences", "2,1", "--widths", "3,1"]
    assert batched_verify.main([*argv, "--passes", "1", "--prefix", "16"]) == 0
    out = capsys.readouterr().out
    for k, w in [(1, 1), (2, 1), (1, 3), (2, 3)]:
        assert f"\n| {k} | {w} | {k * w} | " in out
    assert "### nowhere.gguf: skipped (nowhere.gguf: not bundled" in out
    assert "KiB a slot" in out


def test_a_shared_cache_may_hold_more_slots_than_the_trained_context() -> None:
    """Positions count within a sequence, so only a sequence's context is bounded by the
    model's (the bundled target's 2048); a sequence in slots past 2048 computes what it
    does in a runtime of its own."""
    path = TARGET / "target-q8_0.gguf"
    batch = NativeSequences.load(path, 2600, threads=2)
    assert (batch.model.capacity, batch.model.context) == (2600, 2048)
    with pytest.raises(RuntimeUsageError, match="past the model's 2048"):
        batch.open(2049)
    first, second = batch.open(2048), batch.open(552)
    assert second.base == 2048
    prompt = list(range(3, 503))
    second.prefill(prompt)
    single = NativeRuntime(path, n_ctx=600, threads=2)
    single.prefill(prompt)
    np.testing.assert_array_equal(second.last_logits(), single.last_logits())
    [rows] = batch.evaluate([Tree(second, [7, 8, 9], [-1, 0, 0])])
    np.testing.assert_array_equal(rows, single.evaluate_tree([7, 8, 9], [-1, 0, 0]))
    first.prefill(prompt[:10])
    with pytest.raises(ModelFormatError, match=r"outside what the model allows \(1..2048\)"):
        NativeModel(path, capacity=2049)  # a cache of one sequence: the context as before


def resident_mib() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def test_a_shared_cache_takes_memory_as_its_slots_are_written() -> None:
    """A 65536-slot cache of the bundled target is 128 MiB; a sequence writing 100 slots of
    it must not make more of it resident (numpy's huge-page advice made 2 MiB of every plane
    a write touched resident: 64 MiB here)."""
    batch = NativeSequences.load(TARGET / "target-q8_0.gguf", 65536, threads=2)
    assert batch.model.keys.nbytes + batch.model.values.nbytes == 128 * 2**20
    batch.open(2048).prefill([5])  # scratch and weights touched once, before measuring
    for _ in range(15):  # the next one far from the first's pages
        batch.open(2048)
    sequence = batch.open(2048)
    assert sequence.base == 32768
    before = resident_mib()
    sequence.prefill(list(range(3, 103)))
    assert resident_mib() - before < 8


def test_every_sequence_of_a_native_drafter_drafts_in_one_call_what_the_first_drafts() -> None:
    """A sequence after the cache's first range drafts a chain and side-by-side branches in
    one call of the draft loops (its committed slots listed, not the prefix), the same tokens
    and rows as the first range, greedy and seeded."""
    runtime = NativeRuntime(TARGET / "target-q8_0.gguf", n_ctx=256, sequences=3)
    calls = []
    for sequence in (runtime, *runtime.siblings):
        chain, branches = sequence._run_chain, sequence._run_branches
        sequence._run_chain = lambda *a, _run=chain, **k: calls.append("chain") or _run(*a, **k)
        sequence._run_branches = lambda *a, _run=branches, **k: (
            calls.append("branches") or _run(*a, **k)
        )
    prompt = runtime.tokenize("def fibonacci(n):\n    ")
    drafts = []
    for sequence in (runtime, *runtime.siblings):
        sequence.prefill(prompt[: len(prompt) - 2])
        sequence.append(prompt[-2:])  # a committed length that is not the prompt's
        greedy = sequence.draft(5, SamplingParams(), DrawnSampler(0))
        sequence.rollback(len(prompt))
        seeded = sequence.draft(4, SamplingParams(temperature=0.8), KeyedSampler(7))
        sequence.rollback(len(prompt))
        branched = sequence.draft(3, SamplingParams(), DrawnSampler(0), branches=3)
        drafts.append((greedy.tokens.tolist(), seeded.tokens.tolist(), branched.tokens.tolist()))
    assert drafts[1] == drafts[0]
    assert drafts[2] == drafts[0]
    assert calls.count("chain") == 6
    assert calls.count("branches") == 3

"""What each side computes in one HCMP verification forward (Ghidorah's split of the target).

HCMP splits every linear layer's output columns by a ratio between two sides (``GPU`` takes
the first ``column_split`` columns, ``CPU`` the rest; no all-reduce: each writes its own
columns) and each attention head into a dense part (the queries against the KV cache before
the attention boundary, on the GPU side) and a sparse part (against the draft tree's keys from
the boundary on, the CPU side), merged by log-sum-exp. At ratio 0 or 1 one side computes
everything (the unsplit forward).

``forward_work`` lists that work as ``Work`` items grouped in steps (the sides compute a
step's items at once, then meet): the torch forward
(workers/runtimes/torch_runtime/hcmp_forward.py) records the same list as it runs, and
``unified_board`` replays it at a board's cost. Norms, RoPE, residuals and the merge
(elementwise, on the GPU side) are not listed. Pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetspec.protocol.config_shape import ConfigShape

GPU = "gpu"
CPU = "cpu"


@dataclass(frozen=True)
class Work:
    """One side's share of one operation.

    ``kind`` "linear": ``rows`` x ``inner`` activations times ``columns`` of the weight;
    "dense" / "sparse": attention of ``rows`` queries (``heads`` of them, ``kv_heads`` key
    heads of ``inner`` dims) over ``columns`` keys. ``step``: items of one step run at once.
    """

    step: int
    side: str
    kind: str
    name: str
    rows: int
    inner: int
    columns: int
    heads: int = 1
    kv_heads: int = 1

    def flops(self) -> int:
        """Multiply-adds times two, as computed (attention densely over its keys)."""
        if self.kind == "linear":
            return 2 * self.rows * self.inner * self.columns
        return 4 * self.heads * self.rows * self.columns * self.inner

    def bytes(self, weight_bytes: float, activation_bytes: float) -> float:
        """Bytes moved: a linear's weight share plus its input and output; an attention
        part's keys and values plus its queries and output."""
        if self.kind == "linear":
            moved = self.rows * (self.inner + self.columns) * activation_bytes
            return self.columns * self.inner * weight_bytes + moved
        cache = 2 * self.kv_heads * self.columns * self.inner * activation_bytes
        return cache + 2 * self.heads * self.rows * self.inner * activation_bytes


def column_split(columns: int, ratio: float) -> int:
    """How many of a linear's ``columns`` (output features) the GPU side computes at ``ratio``
    (its share in [0, 1]): ``round(ratio * columns)``, so 0 and 1 give a side everything."""
    if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        raise ValueError(f"split ratio {ratio} is outside [0, 1]")
    return round(ratio * columns)


def attention_boundary(committed: int, shift: int, keys: int) -> int:
    """The first key of the sparse part: the committed cache's end moved by ``shift`` keys
    (positive: the tree's first keys join the dense part), within [0, keys]."""
    return min(max(committed + shift, 0), keys)


def linear_step(
    step: int, name: str, *, rows: int, inner: int, columns: int, ratio: float
) -> list[Work]:
    """Both sides' shares of one linear (a side with no columns does no work)."""
    gpu = column_split(columns, ratio)
    shares = [(GPU, gpu), (CPU, columns - gpu)]
    return [Work(step, side, "linear", name, rows, inner, n) for side, n in shares if n]


def forward_work(
    shape: ConfigShape,
    *,
    width: int,
    committed: int,
    ratio: float,
    shift: int = 0,
    pending: int = 0,
) -> list[Work]:
    """The work of one verification forward of ``width`` new tokens after ``committed`` cached
    ones and ``pending`` earlier tree nodes: per layer the q/k/v step, the attention step,
    o_proj, gate/up and down; then the output head. At ratio 0 or 1 attention is one side's
    (dense and sparse parts both)."""
    h, d, ffn = shape.hidden, shape.head_dim, shape.intermediate
    keys = committed + pending + width
    boundary = attention_boundary(committed, shift, keys)
    dense_side = CPU if ratio == 0.0 else GPU
    sparse_side = GPU if ratio == 1.0 else CPU
    heads = {"heads": shape.heads, "kv_heads": shape.kv_heads}
    work: list[Work] = []
    step = 0

    def linears(layer: str, inner: int, *columns: tuple[str, int]) -> None:
        for name, count in columns:
            work.extend(
                linear_step(
                    step, f"{layer}{name}", rows=width, inner=inner, columns=count, ratio=ratio
                )
            )

    for layer in (f"{i}." for i in range(shape.layers)):
        linears(layer, h, ("q_proj", shape.heads * d), ("k_proj", shape.kv_heads * d))
        linears(layer, h, ("v_proj", shape.kv_heads * d))
        step += 1
        for side, kind, count in (
            (dense_side, "dense", boundary),
            (sparse_side, "sparse", keys - boundary),
        ):
            if count:
                work.append(Work(step, side, kind, f"{layer}attention", width, d, count, **heads))
        step += 1
        linears(layer, shape.heads * d, ("o_proj", h))
        step += 1
        linears(layer, h, ("gate_proj", ffn), ("up_proj", ffn))
        step += 1
        linears(layer, ffn, ("down_proj", h))
        step += 1
    linears("", h, ("lm_head", shape.vocab))
    return work

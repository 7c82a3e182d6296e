"""Messages of FlowSpec's pipeline: a coordinator and the stage processes holding the target's
layers, over ZeroMQ on TCP with CURVE (docs/beyond-one-box.md).

Rows of token ids or hidden states travel as raw frames after the message (``protocol.frames``:
MessagePack header, then one frame per array); nothing is pickled. Every message names the
``session`` it belongs to (a new one per request); a stage drops messages of other sessions,
so what a failed request left in flight never reaches the next one.
"""

from __future__ import annotations

import msgspec

from hetspec.protocol.arena import ArrayRef

PIPELINE_PROTOCOL_VERSION = 2


class _StageMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    pass


# ---------------------------------------------------------------- coordinator -> every stage


class Reset(_StageMessage, tag="reset"):
    """Start ``session`` on an empty cache. Rows a stage computes go to ``next`` (a ZeroMQ TCP
    endpoint: the next stage's, or for the last stage the coordinator's), whose CURVE public
    key (Z85) is ``next_key``; replies (``Ready``, ``StageFailed``, the last stage's
    ``Output``) go to ``coordinator`` (key ``coordinator_key``)."""

    session: int
    index: int  # the stage's place in the pipeline (0: the first)
    next: str
    next_key: str
    coordinator: str
    coordinator_key: str
    version: int = PIPELINE_PROTOCOL_VERSION


class Commit(_StageMessage, tag="commit"):
    """The coordinator's ``epoch``-th advance (1-based): ``accepted`` node ids join the
    committed context in this order; pending nodes below ``root`` stay; the rest go."""

    session: int
    epoch: int
    accepted: list[int]
    root: int


# ---------------------------------------------------------------- along the pipeline


class Rows(_StageMessage, tag="rows"):
    """Rows to compute: token ids (n,) int64 into the first stage, hidden states (n, hidden)
    float32 between stages. ``prefill``: extend the committed context causally (``ids`` empty),
    after which the tree hangs below node ``root``; otherwise tree nodes ``ids`` with
    ``parents`` and ``positions``, made after ``epoch`` commits."""

    session: int
    data: ArrayRef
    ids: list[int] = []
    parents: list[int | None] = []
    positions: list[int] = []
    epoch: int = 0
    prefill: bool = False
    root: int = 0
    costs_ms: list[float] = []  # each stage so far appends its compute time for these rows
    widths: list[int] = []  # and how many rows it computed (the live ones)


# ---------------------------------------------------------------- a stage -> the coordinator


class Output(_StageMessage, tag="output"):
    """The last stage's float32 logits (n, vocab) for nodes ``ids`` (prefill: the last
    prompt row only, ``ids`` empty)."""

    session: int
    logits: ArrayRef
    ids: list[int] = []
    prefill: bool = False
    costs_ms: list[float] = []  # every stage's compute time for these rows, in stage order
    widths: list[int] = []  # how many rows each stage computed


class Ready(_StageMessage, tag="ready"):
    """A stage's answer to ``Reset``: its cache is empty and it holds half-layers
    ``first_half`` .. ``end_half`` - 1 (half 2i: layer i's attention, 2i + 1: its MLP) of a
    model with ``layers`` layers, in a cache of ``context`` slots."""

    session: int
    index: int
    stage: str
    first_half: int
    end_half: int
    layers: int
    context: int
    version: int = PIPELINE_PROTOCOL_VERSION


class StageFailed(_StageMessage, tag="failed"):
    """A stage could not compute ``session``'s rows (one line why); the request fails."""

    session: int
    stage: str
    message: str


ToStage = Reset | Commit | Rows
ToCoordinator = Ready | Output | StageFailed

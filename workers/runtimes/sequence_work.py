"""What a forward over several sequences takes: a ``Tree`` or a ``Chunk`` per sequence.

Contract: plain values naming a sequence's engine (a ``TreeRuntime`` of the runtime that
evaluates them, e.g. a ``NativeSequence``) and what to evaluate in it; the runtime's
multi-sequence forward (``NativeSequences.evaluate``, ``NativeRuntime.evaluate_together``)
says what each leaves behind. Kept apart from any runtime so that the worker can name the work
without importing one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Tree:
    """A token tree below ``sequence``'s committed end (``parents`` as ``forward_tree``'s),
    or with ``extend`` joining its pending tree: evaluated, its nodes left pending."""

    sequence: object
    tokens: Sequence[int]
    parents: Sequence[int]
    extend: bool = False


@dataclass(frozen=True)
class Chunk:
    """Tokens to follow ``sequence``'s committed ones (a prompt's chunk, or the token a
    decoding step drew; the pending tree is dropped), committed once evaluated."""

    sequence: object
    tokens: Sequence[int]

"""A model's vocabulary identity, as a worker reports it to the daemon."""

from __future__ import annotations

import msgspec


class VocabInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: str  # "bpe", "spm", ...
    size: int  # rows of the logits, padding included
    real_size: int  # ids up to the last non-padding token
    bos: int
    eos: int
    add_bos: bool
    # sha256 of the texts of ids 5 .. real_size - 1 (hetspec.speculative.drafting.vocab_match)
    fingerprint: str
    # every id that ends generation: eos and the end-of-turn tokens (llama.cpp's "EOG" set)
    ends: tuple[int, ...] = ()


class VocabReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``python -m hetspec.workers.tools.describe`` prints: a model file's vocabulary as a
    worker reads it, or why it cannot be read."""

    path: str
    vocab: VocabInfo | None = None
    error: str | None = None

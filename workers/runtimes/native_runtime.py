"""NativeRuntime: token trees on hetspec's own CPU kernels (hetspec.native), over a GGUF file.

Laid out as the torch runtime is: the committed tokens' keys/values fill cache slots
0..committed-1 and the pending tree's nodes the slots after them, in evaluation order;
committing a path copies its slots right after the prefix. Each new node attends to the
prefix and to its ancestors' slots, listed per node (no dense mask): the hooks are
``native_sequences.NativeSequence``'s, this runtime being the sequence that owns the whole
cache (or, serving several sequences, the first range of it: see ``evaluate_together``).
The kernels compute every row the same way whatever the width of the call, so a
token's logits inside a tree equal its logits evaluated on their own, bit for bit: greedy
verification returns exactly what this runtime decodes alone. The vocabulary comes from
llama.cpp (the file loaded ``vocab_only``), so this runtime tokenizes exactly as the
llama.cpp workers do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from hetspec.native.kernels import BEST, SIMD_LEVELS, NativeUnavailable
from hetspec.native.model import DEFAULT_MAX_CONTEXT, NativeModel
from hetspec.protocol.gguf_checks import GGUFMetadataError, check_model_file
from hetspec.protocol.gguf_header import GGUFFormatError
from hetspec.speculative.drafting.vocab_match import VocabInfo
from hetspec.workers.runtimes.llama_cpp_runtime.vocabulary import VocabularyFile
from hetspec.workers.runtimes.native_sequences import NativeSequence, NativeSequences
from hetspec.workers.runtimes.sequence_work import Chunk, Tree


def default_context(path: Path) -> int:
    """The context a sequence gets where no ``n_ctx`` is given: the trained one, at most
    ``DEFAULT_MAX_CONTEXT`` (read from the header alone; a header that cannot say leaves it
    to ``NativeModel``, which then refuses the file with the reason)."""
    try:
        shape = check_model_file(path)
    except (GGUFMetadataError, GGUFFormatError, OSError):
        shape = None
    trained = shape.context_length if shape is not None else DEFAULT_MAX_CONTEXT
    return min(trained, DEFAULT_MAX_CONTEXT)


class NativeRuntime(NativeSequence):
    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int | None = None,
        threads: int | None = None,
        simd: str | None = None,
        pack: bool | None = None,
        sequences: int = 1,
    ) -> None:
        """Load a Llama, Qwen2 or Qwen3 GGUF file (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
        Q6_K, IQ4_NL, IQ4_XS, F16 or F32 weights); ``threads`` defaults to the cores this
        process may run on; ``simd`` caps the kernels' level (``SIMD_LEVELS``; None: the best
        here); ``pack``: packed copies of Q8_0 matrices (None: ``NativeModel``'s choice).
        ``sequences`` > 1: a cache of that many ranges of ``n_ctx`` slots, this runtime the
        sequence in the first and ``siblings`` the others (``NativeSequence``s of the same
        weights), evaluated together by ``evaluate_together``.
        Raises ``NativeUnavailable`` with the reason."""
        path = Path(model_path)
        if not path.is_file():
            raise NativeUnavailable(f"{path}: no such file")
        owned = len(os.sched_getaffinity(0))
        threads = threads or owned
        if not 0 < threads <= owned:
            raise NativeUnavailable(
                f"{threads} threads requested but this process owns {owned} cores"
            )
        if simd is not None and simd not in SIMD_LEVELS:
            raise NativeUnavailable(
                f"no {simd} kernels on this architecture: it has {', '.join(SIMD_LEVELS)}"
            )
        if sequences < 1:
            raise NativeUnavailable(f"cannot serve {sequences} sequences")
        level = BEST if simd is None else SIMD_LEVELS[simd]
        if sequences == 1:
            model = NativeModel(path, n_ctx, level, pack=pack)
        else:  # a shared cache: its slots committed as first written, a range a sequence
            n_ctx = n_ctx or default_context(path)
            model = NativeModel(path, sequences * n_ctx, level, pack=pack, shared=True)
            if model.context < n_ctx:
                raise NativeUnavailable(
                    f"{path}: context {n_ctx} is outside what the model allows (1..{model.context})"
                )
        level = model.kernels.level_for(BEST if simd is None else SIMD_LEVELS[simd])
        self.kernels = next(name for name, value in SIMD_LEVELS.items() if value == level)
        vocabulary = VocabularyFile.open(path)
        if vocabulary is None:
            raise NativeUnavailable(f"{path}: llama.cpp could not read its vocabulary")
        if vocabulary.size != model.vocab:
            raise NativeUnavailable(
                f"{path}: {vocabulary.size} tokens in the vocabulary but "
                f"{model.vocab} embedding rows"
            )
        self._vocabulary = vocabulary
        self.path = path
        super().__init__(model, 0, model.capacity // sequences, threads)
        self.batch = NativeSequences(model, threads)
        self.batch.adopt(self)
        self.siblings = [self.batch.open(self.capacity) for _ in range(sequences - 1)]

    def evaluate_together(self, work: Sequence[Tree | Chunk]) -> list[np.ndarray]:
        """``NativeSequences.evaluate`` of this runtime's sequences (itself and its
        ``siblings``), on its threads (the spare cores' included while lent): each row bit for
        bit what its sequence evaluates on its own."""
        return self.batch.evaluate(work, threads=self.threads + self._extra_threads)

    # ------------------------------------------------------------ vocabulary

    def vocab_info(self) -> VocabInfo:
        return self._vocabulary.info()

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self._vocabulary.tokenize(text, add_special=add_special)

    def token_bytes(self, token: int) -> bytes:
        return self._vocabulary.token_bytes(token)

    def special_tokens(self) -> list[int]:
        return self._vocabulary.special_tokens()

    # The widest chain first, then 1, 2, ... for a second. The kernels keep no state per width
    # (torch's reason to run every width), but a width's first call costs a little more than
    # the next ones: what matters on a small model, nothing on a large one, where warming up
    # every width would take half a minute (docs/design-notes.md, "Warm-up of widths").
    warm_up_s = 1.0

    def warm_up_widths(self, width: int) -> Iterable[int]:
        return (width, *range(1, width))

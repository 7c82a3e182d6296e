"""Vocabulary identity: can a draft model's tokens be fed to a target model as they are?

Speculative decoding passes token ids between two models, so both must map every id to the
same text. The rule follows llama.cpp's own check for draft models: same tokenizer kind, same
BOS/EOS ids and add-BOS setting, sizes within 128 (exporters pad the embedding table), and
identical text for every id from 5 on (the first ids are specials that exporters rename).
A fingerprint of those texts lets two processes compare vocabularies without shipping them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from hetspec.protocol.vocab import VocabInfo

__all__ = ["VocabInfo", "incompatibilities", "is_padding", "vocab_info"]

FIRST_COMPARED_ID = 5
MAX_SIZE_DIFFERENCE = 128


def is_padding(text: bytes, token_id: int) -> bool:
    """The filler exporters put after the real vocabulary (llama.cpp's converter: [PAD{id}])."""
    return text == f"[PAD{token_id}]".encode()


def vocab_info(
    kind: str,
    texts: Sequence[bytes],
    bos: int,
    eos: int,
    add_bos: bool,
    *,
    ends: Sequence[int] = (),
) -> VocabInfo:
    """``ends``: ids besides ``eos`` that end generation."""
    real_size = len(texts)
    while real_size > 0 and is_padding(texts[real_size - 1], real_size - 1):
        real_size -= 1
    digest = hashlib.sha256()
    for text in texts[FIRST_COMPARED_ID:real_size]:
        digest.update(len(text).to_bytes(4, "little"))
        digest.update(text)
    every_end = tuple(sorted({eos, *ends} - {-1}))
    return VocabInfo(kind, len(texts), real_size, bos, eos, add_bos, digest.hexdigest(), every_end)


def incompatibilities(draft: VocabInfo, target: VocabInfo) -> list[str]:
    """Why the draft's ids cannot be verified by the target; empty when they can."""
    problems = []
    if draft.kind != target.kind:
        problems.append(f"tokenizer kinds differ ({draft.kind} vs {target.kind})")
    if (draft.bos, draft.eos) != (target.bos, target.eos):
        problems.append(
            f"BOS/EOS ids differ ({draft.bos}/{draft.eos} vs {target.bos}/{target.eos})"
        )
    if draft.add_bos != target.add_bos:
        problems.append(f"add-BOS differs ({draft.add_bos} vs {target.add_bos})")
    if abs(draft.size - target.size) > MAX_SIZE_DIFFERENCE:
        problems.append(f"vocabulary sizes differ by more than 128 ({draft.size} vs {target.size})")
    if (draft.real_size, draft.fingerprint) != (target.real_size, target.fingerprint):
        problems.append(
            f"token texts differ ({draft.real_size} tokens, fingerprint {draft.fingerprint[:12]} "
            f"vs {target.real_size} tokens, {target.fingerprint[:12]})"
        )
    return problems

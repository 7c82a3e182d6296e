"""Which draft head drafts in the draft-gpu placement (Dovetail's), decided from files alone.

A head matches a target when it reads features as wide as the target's hidden state over a
vocabulary of the target's size (the worker also checks the vocabulary's fingerprint when it
loads). ``draft_head = "auto"`` takes the first match of the target folder's ``draft-head/``
and the bundled head, and drafts with the draft model when none matches; a path must match.
"""

from __future__ import annotations

import json
from pathlib import Path

from hetspec.daemon.config import BUNDLED_MODELS, DaemonConfig

BUNDLED_HEAD = BUNDLED_MODELS / "head"
TARGET_HEAD = "draft-head"  # a head kept beside its target (the heavy targets' are)
HEAD_RUNTIMES = ("auto", "torch")  # the GPU worker runtimes a head can draft in


class HeadChoiceError(ValueError):
    """The configured head cannot draft for the configured target; the message says why."""


def mismatch(head: Path, target_folder: Path) -> str | None:
    """Why ``head`` cannot draft for the target in ``target_folder`` (None: it can)."""
    try:
        shape = json.loads((head / "head_config.json").read_text())
    except FileNotFoundError:
        return f"{head} holds no head_config.json: not a draft head"
    except (OSError, ValueError) as error:
        return f"{head}/head_config.json is unreadable: {error}"
    try:
        target = json.loads((target_folder / "config.json").read_text())
        target = target.get("text_config", target)
        wanted = (int(target["hidden_size"]), int(target["vocab_size"]))
        found = (int(shape["feature_size"]), int(shape["vocab_size"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"cannot compare {head} with {target_folder}: {error}"
    if found != wanted:
        return (
            f"{head} reads {found[0]}-wide features over {found[1]} tokens; the target "
            f"{target_folder} has {wanted[0]} and {wanted[1]}"
        )
    return None


def draft_head_for(config: DaemonConfig) -> Path | None:
    """The head the GPU worker drafts with, or None (the draft model). Raises
    ``HeadChoiceError`` for a configured head that does not match the target."""
    if (
        config.placement != "draft-gpu"
        or config.draft_head == "none"
        or config.gpu_runtime not in HEAD_RUNTIMES
    ):
        return None
    if not config.target.folder:  # a head reads the target's folder (embedding, LM head)
        if config.draft_head not in ("auto", "none"):
            raise HeadChoiceError(
                "draft_head: a head reads the target's model folder, and "
                'the target has none (target.folder = "")'
            )
        return None
    target = Path(config.target.folder)
    if config.draft_head != "auto":
        head = Path(config.draft_head)
        if (problem := mismatch(head, target)) is not None:
            raise HeadChoiceError(f"draft_head: {problem}")
        return head
    for candidate in (target / TARGET_HEAD, BUNDLED_HEAD):
        if candidate.is_dir() and mismatch(candidate, target) is None:
            return candidate
    return None

"""The frozen target that trains and measures draft heads (``models/train_head.Teacher``)
computes what the torch runtime computes, at every position of a window."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import build_reference, save_reference

from hetspec.models.train_head import Teacher
from hetspec.workers.runtimes.torch_runtime import TorchRuntime

MODELS = Path(__file__).resolve().parents[1] / "models"


def folder_of(tmp_path: Path, name: str) -> Path:
    if name in ("target", "draft"):
        return MODELS / name
    return save_reference(build_reference(name), tmp_path / name)


# the bundled pair (Llama), and Gemma's windowed layers, second rotary table and soft caps
@pytest.mark.parametrize("name", ["target", "draft", "gemma3", "gemma2"])
def test_every_positions_log_probabilities_are_the_runtimes(tmp_path, name) -> None:
    folder = folder_of(tmp_path, name)
    teacher = Teacher(folder)
    vocab = teacher.config.vocab_size
    tokens = torch.from_numpy(np.random.default_rng(0).integers(3, vocab, size=(2, 24)))
    features, log_p = teacher(tokens)
    assert features.shape == (2, 24, teacher.config.hidden_size)
    assert log_p.shape == (2, 24, vocab)

    runtime = TorchRuntime(folder, device="cpu", dtype="float32", max_context=64)
    for row in range(2):
        ids = tokens[row].tolist()
        runtime.prefill(ids[:1])
        for n in range(1, 25):  # the runtime one token at a time, the teacher all at once
            if n > 1:
                runtime.append(ids[n - 1 : n])
            expected = torch.from_numpy(runtime.last_logits().copy()).log_softmax(-1)
            assert torch.allclose(log_p[row, n - 1], expected, atol=2e-4), (row, n)


def test_a_window_longer_than_the_context_is_refused() -> None:
    teacher = Teacher(MODELS / "draft")
    too_long = torch.zeros(1, teacher.config.max_context + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="exceed the model's"):
        teacher(too_long)

"""models/int8_quality.py: what int8 weights cost the bundled target, emulated in float32."""

from __future__ import annotations

import re

import pytest
import torch

from hetspec.models import int8_quality
from hetspec.models.train_head import Teacher
from hetspec.workers.runtimes.torch_runtime.int8_weights import quantize_rows

TARGET = int8_quality.MODELS / "target"


def test_the_rounded_model_keeps_its_embedding_and_rounds_every_matmul() -> None:
    full, rounded = Teacher(TARGET), int8_quality.rounded_as_int8(Teacher(TARGET))
    embedding = full.model.model.embed_tokens.weight
    assert torch.equal(rounded.model.model.embed_tokens.weight, embedding)  # lookups unchanged
    quantized, scale = quantize_rows(full.model.head_weight())
    head = rounded.model.quantized_head
    assert torch.equal(head.weight, quantized)
    assert torch.equal(head.scale, scale)
    up = rounded.model.model.layers[0].mlp.up_proj
    assert up.weight.dtype == torch.int8  # every matmul's weight a whole number of steps
    assert torch.equal(up.weight, quantize_rows(full.model.model.layers[0].mlp.up_proj.weight)[0])


def test_the_report_says_how_close_int8_stays(capsys) -> None:
    assert (
        int8_quality.main(
            ["--files", "2", "--tokens", "64", "--draft", str(int8_quality.MODELS / "draft")]
        )
        == 0
    )
    report = capsys.readouterr().out
    agreement = float(re.search(r"first choice is the full model's at ([\d.]+)%", report)[1])
    assert agreement > 90  # 99.2% over 8 files x 256 tokens when measured
    full, int8 = map(
        float, re.search(r"perplexity on the text: full ([\d.]+), int8 ([\d.]+)", report).groups()
    )
    assert abs(int8 / full - 1) < 0.02
    assert "the draft's first choice is the target's: full" in report


def test_windows_the_triton_kernel_would_take_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        int8_quality.main(["--tokens", "16"])
    assert "--tokens must be more than 16, not 16" in capsys.readouterr().err


def test_a_folder_that_does_not_load_is_an_error_not_a_traceback(tmp_path, capsys) -> None:
    assert int8_quality.main(["--model", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("error: ")

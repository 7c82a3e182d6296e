"""The demo pair shipped in models/: both exports load, agree, and fit the size budget."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hetspec.speculative.drafting.vocab_match import incompatibilities
from hetspec.speculative.verify.tree import chain_parents
from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime
from hetspec.workers.runtimes.torch_runtime import TorchRuntime

MODELS = Path(__file__).resolve().parents[1] / "models"
TEXT = textwrap.dedent('''\
    import os


    def read_config(path, *, encoding="utf-8"):
        """Return the parsed configuration at path, or {} when it is missing."""
        if not os.path.exists(path):
            return {}
        with open(path, encoding=encoding) as handle:
            return parse(handle.read())
    <|im_start|>user
    héllo wörld 漢字 🙂<|im_end|>
''')


@pytest.fixture(scope="module")
def folders() -> dict[str, TorchRuntime]:
    return {name: TorchRuntime(MODELS / name, max_context=512) for name in ("target", "draft")}


def test_the_pair_fits_the_size_budget_and_the_draft_is_much_smaller(folders) -> None:
    shipped = [p for p in MODELS.rglob("*") if p.is_file() and p.suffix != ".py"]
    real_draft = [p for p in shipped if p.parent.name == "smollm2-draft"]  # its own budget
    total = sum(p.stat().st_size for p in shipped if p not in real_draft)
    assert total < 40 * 2**20, f"{total / 2**20:.1f} MiB shipped"
    drafted = sum(p.stat().st_size for p in real_draft)
    assert drafted < 20 * 2**20, f"the SmolLM2 draft: {drafted / 2**20:.1f} MiB shipped"
    sizes = {n: sum(p.numel() for p in r.model.parameters()) for n, r in folders.items()}
    assert 5 <= sizes["target"] / sizes["draft"] <= 10, sizes
    card = (MODELS / "MODEL_CARD.md").read_text()
    metrics = json.loads((MODELS / "metrics.json").read_text())
    assert f"{metrics['held_out']['greedy_agreement']:.2f}" in card


@pytest.mark.parametrize("name", ["target", "draft"])
@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_every_gguf_export_has_the_folders_tokens_and_logits(folders, name, gguf_type) -> None:
    folder = folders[name]
    gguf = LlamaCppRuntime(MODELS / name / f"{name}-{gguf_type}.gguf", n_ctx=512, threads=1)
    assert gguf.vocab_info() == folder.vocab_info()
    tokens = folder.tokenize(TEXT)
    assert gguf.tokenize(TEXT) == tokens
    assert b"".join(gguf.token_bytes(t) for t in tokens[1:]).decode() == TEXT

    folder.prefill(tokens[:1])
    expected = folder.evaluate_tree(tokens[1:], chain_parents(len(tokens) - 1))
    gguf.prefill(tokens[:1])
    ours = gguf.evaluate_tree(tokens[1:], chain_parents(len(tokens) - 1))
    agreement = (ours.argmax(-1) == expected.argmax(-1)).mean()
    difference = np.abs(ours - expected).max()
    # half precision and 8-bit weights move logits a little, and almost never the argmax
    assert agreement >= 0.95, agreement
    assert difference < (0.05 if gguf_type == "f16" else 0.5), difference


def test_draft_and_target_share_one_tokenizer_and_a_chat_template(folders) -> None:
    assert incompatibilities(folders["draft"].vocab_info(), folders["target"].vocab_info()) == []
    for name in folders:
        settings = json.loads((MODELS / name / "tokenizer_config.json").read_text())
        assert "<|im_start|>" in settings["chat_template"]

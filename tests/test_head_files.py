"""A trained draft head's folder appears whole or not at all (``train_head.save_head``)."""

from __future__ import annotations

import pytest
import torch

from hetspec.models import train_head
from hetspec.models.cache_files import leftovers
from hetspec.workers.runtimes.torch_runtime.draft_head import DraftHead, HeadConfig, load_head

CONFIG = HeadConfig(
    feature_size=32,
    width=32,
    vocab_size=64,
    blocks=1,
    fusion="dgf",
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=48,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_context=128,
    vocab_fingerprint="test",
)
TARGET = CONFIG.block_config()  # a target of the head's width and vocabulary


def test_a_saved_head_loads_with_its_weights(tmp_path) -> None:
    torch.manual_seed(0)
    head = DraftHead(CONFIG)
    train_head.save_head(head, CONFIG, tmp_path / "head")
    loaded = load_head(tmp_path / "head", TARGET, torch.float32, torch.device("cpu"))
    for (name, mine), (_, theirs) in zip(
        head.named_parameters(), loaded.named_parameters(), strict=True
    ):
        assert torch.equal(mine.detach().to(torch.float16).float(), theirs.detach()), name
    assert not leftovers(tmp_path / "head")


def test_a_save_that_fails_leaves_the_earlier_head_and_nothing_half_written(
    tmp_path, monkeypatch
) -> None:
    out = tmp_path / "head"
    earlier = DraftHead(CONFIG)
    train_head.save_head(earlier, CONFIG, out)
    before = (out / "model.safetensors").read_bytes()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a Ctrl-C while writing the weights

    monkeypatch.setattr(train_head, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        train_head.save_head(DraftHead(CONFIG), CONFIG, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert not leftovers(out)

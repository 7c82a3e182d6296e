"""Gemma 2 and 3 config.json files as published read the way transformers reads them.

The tiny models in tiny_models.py are written by the installed transformers (``layer_types``,
per-layer-type ``rope_parameters``); the files people download are older: a window period
instead of layer types, ``rope_local_base_freq`` beside ``rope_theta``, ``rope_scaling`` for
the full layers only. Each case here is such a file's shape (weights are not needed to check
the reading), compared field by field with transformers' own interpretation.
"""

from __future__ import annotations

import pytest
import transformers

from hetspec.workers.runtimes.torch_runtime.config import ModelConfig, ModelLoadError

GEMMA3_1B = {  # google/gemma-3-1b-it (transformers 4.50)
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "attention_bias": False,
}
GEMMA3_270M = {  # google/gemma-3-270m (transformers 4.55: layer_types written out)
    **GEMMA3_1B,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
    ],
}
GEMMA3_LINEAR = {  # a 4B-like text stack: linear scaling of the full layers' rotary angles
    **GEMMA3_1B,
    "hidden_size": 2560,
    "num_hidden_layers": 34,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}
GEMMA2_2B = {  # google/gemma-2-2b-it
    "model_type": "gemma2",
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "attention_bias": False,
}
GEMMA2_27B_QUERY = {
    **GEMMA2_2B,
    "num_hidden_layers": 46,
    "hidden_size": 4608,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "query_pre_attn_scalar": 144,
}


@pytest.mark.parametrize(
    "raw",
    [GEMMA3_1B, GEMMA3_270M, GEMMA3_LINEAR, GEMMA2_2B, GEMMA2_27B_QUERY],
    ids=["gemma3-1b", "gemma3-270m", "gemma3-linear", "gemma2-2b", "gemma2-27b-query"],
)
def test_published_gemma_configs_read_as_transformers_reads_them(raw) -> None:
    ours = ModelConfig.from_dict(dict(raw))
    theirs = transformers.AutoConfig.for_model(**dict(raw))
    windows = tuple(
        theirs.sliding_window if kind == "sliding_attention" else None
        for kind in theirs.layer_types
    )
    assert ours.sliding_windows == windows
    assert ours.query_scale == pytest.approx(theirs.query_pre_attn_scalar**-0.5)
    assert ours.attn_softcap == theirs.attn_logit_softcapping
    assert ours.final_softcap == theirs.final_logit_softcapping
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.activation == "gelu_tanh"
    assert ours.embed_scale == pytest.approx(theirs.hidden_size**0.5)
    params = theirs.rope_parameters
    if raw["model_type"] == "gemma3_text":
        full, local = params["full_attention"], params["sliding_attention"]
        ropes = [ours.rope_kinds[kind] for kind in ours.layer_ropes]
        expected = [local if kind == "sliding_attention" else full for kind in theirs.layer_types]
        assert [r.theta for r in ropes] == [float(p["rope_theta"]) for p in expected]
        assert [r.kind for r in ropes] == [p["rope_type"] for p in expected]
        assert [r.factor for r in ropes] == [float(p.get("factor", 1.0)) for p in expected]
    else:
        assert ours.window_rope is None
        assert ours.rope.theta == params["rope_theta"]


def test_an_embedding_gemma_is_refused_by_name() -> None:
    with pytest.raises(ModelLoadError, match="bidirectional"):
        ModelConfig.from_dict({**GEMMA3_1B, "use_bidirectional_attention": True})


def test_a_gemma_activation_other_than_tanh_gelu_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="hidden_activation 'relu'"):
        ModelConfig.from_dict({**GEMMA2_2B, "hidden_activation": "relu"})

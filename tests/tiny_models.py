"""Tiny random Hugging Face checkpoints of every architecture the torch runtime supports.

Weights are redrawn larger than transformers' init so logits spread out and a wrong rotary
layout, mask or bias shows up as a real difference.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}

# name -> (model_type, extra config)
TINY_CONFIGS = {
    "llama3-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama-linear-bias-tied": (
        "llama",
        {
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
        },
    ),
    "mistral-window": ("mistral", {"sliding_window": 6, "num_key_value_heads": 1}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 24, "tie_word_embeddings": False}),
    # windows of 6 positions on layers 0 and 2, a global layer between (its own rotary base);
    # query_pre_attn_scalar as llama.cpp assumes it (head_dim)
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "num_hidden_layers": 3,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
            "tie_word_embeddings": True,
        },
    ),
    # windows of 6 on the even layers, soft caps small enough to bite on these random weights
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "num_hidden_layers": 3,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 4.0,
            "tie_word_embeddings": True,
        },
    ),
}


def build_reference(name: str, seed: int = 0):
    """A transformers model (fp32, eager attention) for the named tiny config."""
    import transformers  # noqa: PLC0415 (heavy; only the tests that need it pay for it)

    model_type, extra = TINY_CONFIGS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model.eval()


def save_reference(model, folder: Path, **save_kwargs) -> Path:
    model.save_pretrained(folder, safe_serialization=True, **save_kwargs)
    return folder


def tokenizer_texts() -> list[str]:
    """A little real Python for the tiny tokenizers (any machine's standard library)."""
    import sysconfig  # noqa: PLC0415

    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text() for name in ("json/__init__.py", "textwrap.py", "glob.py")]


TINY_VOCAB = 320  # write_tiny_gguf_llama's default vocabulary
SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's first ids


def write_sentencepiece_tokenizer(
    folder: Path, vocab_size: int, *, prefix_space: bool = False
) -> int:
    """A BPE with byte fallback laid out as transformers converts SentencePiece models
    (Llama 2's, Gemma's): spaces as U+2581, ``<0xNN>`` pieces for bytes outside the vocabulary,
    no pre-tokenizer; with ``prefix_space`` a space before the text, as Llama 2's (Gemma's
    has none). Writes tokenizer.json and tokenizer_config.json; returns the BOS id."""
    import json  # noqa: PLC0415

    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    spaces = normalizers.Replace(" ", "\u2581")
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if prefix_space else spaces
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    pieces = [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPM_SPECIALS + pieces,
    )
    tokenizer.train_from_iterator(tokenizer_texts(), trainer=trainer)
    bos = tokenizer.token_to_id("<bos>")
    template = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tokenizer.post_processor = template
    spec = json.loads(tokenizer.to_str())
    # the byte pieces are vocabulary, as in a converted SentencePiece model, not added tokens
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPM_SPECIALS]
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    settings = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return bos


DAEMON_CONTEXT = 4096  # the context the daemon tests give the tiny pair


def write_tiny_gguf(
    folder: Path,
    name: str = "llama",
    *,
    seed: int = 0,
    layers: int | None = None,
    vocab_size: int = TINY_VOCAB,
    gguf_type: str = "f32",
    context: int | None = None,
    sentencepiece: bool | str = False,
    **overrides: object,
) -> Path:
    """A random tiny model with a trained byte-level BPE tokenizer: HF folder + GGUF file; a
    plain Llama, or any ``TINY_CONFIGS`` name, with config ``overrides``
    (e.g. an ``intermediate_size`` in whole 32-blocks, as the native kernels need); with
    ``sentencepiece`` its tokenizer is laid out as Gemma's (``write_sentencepiece_tokenizer``;
    ``"prefix-space"``: as Llama 2's).

    Returns the GGUF path; the folder beside it loads in transformers and the torch runtime.
    """
    import transformers  # noqa: PLC0415

    from hetspec.models.gguf_export import export_gguf  # noqa: PLC0415
    from hetspec.models.train_demo import (  # noqa: PLC0415
        BOS,
        train_tokenizer,
        write_tokenizer_files,
    )

    folder.mkdir(parents=True, exist_ok=True)
    if sentencepiece:
        tokens = vocab_size + 256
        prefix_space = sentencepiece == "prefix-space"
        bos = write_sentencepiece_tokenizer(folder, tokens, prefix_space=prefix_space)
    else:
        tokenizer = train_tokenizer(tokenizer_texts(), vocab_size)
        bos, tokens = tokenizer.token_to_id(BOS), tokenizer.get_vocab_size()
    model_type, extra = TINY_CONFIGS.get(name, ("llama", {}))
    config = transformers.AutoConfig.for_model(
        model_type,
        **{
            **COMMON,
            **extra,
            "vocab_size": tokens,
            "num_hidden_layers": layers or extra.get("num_hidden_layers", 2),
            "max_position_embeddings": context or COMMON["max_position_embeddings"],
            **overrides,
        },
        bos_token_id=bos,
        eos_token_id=bos,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            scale = 0.2 if param_name.endswith("norm.weight") else 0.15
            param.copy_(
                (1 if param_name.endswith("norm.weight") else 0) + scale * torch.randn_like(param)
            )
    model.save_pretrained(folder, safe_serialization=True)
    if not sentencepiece:
        write_tokenizer_files(tokenizer, folder, config.max_position_embeddings)
    return export_gguf(folder, folder / f"model-{gguf_type}.gguf", gguf_type)


write_tiny_gguf_llama = write_tiny_gguf  # the name most tests know it by


def write_tiny_pair(root: Path, context: int) -> dict[str, Path]:
    """A tiny target (2 layers) and draft (1 layer) sharing one tokenizer, as the daemon tests
    serve them: {"target": GGUF path, "draft": GGUF path}, each in its own folder."""
    return {
        "target": write_tiny_gguf_llama(root / "target", seed=0, layers=2, context=context),
        "draft": write_tiny_gguf_llama(root / "draft", seed=1, layers=1, context=context),
    }


def compiled_beside_eager(folder: Path, prompt: list[int], **options):
    """(compiled, eager): two torch runtimes of ``folder`` with the same ``options``, one
    through torch.compile, both prefilled with ``prompt``."""
    from hetspec.workers.runtimes.torch_runtime import TorchRuntime  # noqa: PLC0415 (its tests only)

    runtimes = TorchRuntime(folder, compile=True, **options), TorchRuntime(folder, **options)
    for runtime in runtimes:
        runtime.prefill(prompt)
    return runtimes

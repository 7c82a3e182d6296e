"""Export a Hugging Face Llama, Qwen2, Qwen3, Gemma 2 or Gemma 3 (text) folder with a byte-level
BPE tokenizer, or SentencePiece's BPE with byte fallback (Llama 2's, Gemma's), to GGUF.

This covers the models hetspec builds itself (the bundled demo pair, the heavy targets and the
tiny models the tests write), laid out as llama.cpp's own converter lays out these
architectures (its ``llama``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``: biases, q/k norms,
Llama 3's rotary frequency factors, Gemma's shifted norms and sliding windows); other models
come as GGUF from their publishers or llama.cpp's converter. Needs only numpy, safetensors and
gguf, so it runs without torch.

    python -m hetspec.models.gguf_export MODEL_DIR OUT.gguf --type q8_0

The K-quants and IQ4 (``--type q4_k_m``, ``q5_k_m``, ``q6_k``, ``iq4_xs``, ``iq4_nl``) go
through llama.cpp's own quantizer (``hetspec.models.llama_quantize``), from an F16 export.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors import SafetensorError, safe_open

from hetspec.models.llama_quantize import QUANT_TYPES, QuantizeError, quantize_gguf
from hetspec.protocol.tokenizer_files import (
    adds_bos,
    byte_level_pre_name,
    byte_piece,
    is_sentencepiece_bpe,
)

OUT_TYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}

# model_type -> the GGUF architecture it is exported as (Llama's q/k rows are reordered for
# llama.cpp's rotation of adjacent pairs; Qwen's and Gemma's rotate halves, as in HF's layout)
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
# Gemma's model_types -> the layer count of its 27B, whose query scale llama.cpp takes from
# the width per head (see _add_gemma)
GEMMA_WIDE_QUERY_LAYERS = {"gemma2": 46, "gemma3_text": 62}
GEMMA_TYPES = frozenset(GEMMA_WIDE_QUERY_LAYERS)
ARCHITECTURES = tuple(GGUF_ARCHITECTURES)
# Gemma's layer norms: HF's names for its four (input, after attention, before and after the
# feed-forward) -> llama.cpp's
_GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}

_LAYER_TENSORS = {
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


class ExportError(ValueError):
    """The folder is not a model this exporter handles; the message says what is wrong."""


def gguf_tensor_name(hf_name: str, model_type: str = "llama") -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight`."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and parts[-1] in ("weight", "bias"):
        module = ".".join(parts[3:-1])
        gemma = model_type in GEMMA_TYPES and _GEMMA_NORMS.get(module)
        name = gemma or _LAYER_TENSORS.get(module)
        if name:
            return f"blk.{parts[2]}.{name}.{parts[-1]}"
    raise ExportError(f"unexpected tensor {hf_name!r} for a Llama-family model")


def rotary_rows_to_interleaved(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows (or bias entries) from HF's rotary layout to llama.cpp's.

    HF rotates the two halves of each head ([x0..x(d/2-1)] with [x(d/2)..]); llama.cpp's llama
    architecture rotates adjacent pairs (x0 with x1, ...). Per head, row i of the first half
    goes to 2i and row i of the second half to 2i+1.
    """
    head_dim = weight.shape[0] // n_heads
    halves = weight.reshape(n_heads, 2, head_dim // 2, -1)
    return halves.swapaxes(1, 2).reshape(weight.shape)


def _rope(config: dict, layer_type: str = "full_attention") -> tuple[str, dict]:
    """The rotary type ("default", "linear", "llama3") and its parameters, from either
    transformers' ``rope_parameters`` (per layer type where it has them: Gemma 3's) or the
    older ``rope_scaling`` and ``rope_theta``."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if layer_type in rope:
        rope = dict(rope[layer_type])
    elif layer_type == "sliding_attention":  # an older Gemma 3 config
        return "default", {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ExportError(f"rope type {kind!r} is not supported by this exporter")
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return kind, rope


def llama3_frequency_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3's rotary scaling as per-pair factors dividing each pair's frequency (llama.cpp's
    ``rope_freqs.weight``): long wavelengths slowed by ``factor``, short ones kept, a smooth
    blend between."""
    needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if missing := [key for key in needed if key not in rope]:
        raise ExportError(f"llama3 rotary scaling without {', '.join(missing)}")
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    frequencies = float(rope["rope_theta"]) ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelengths = 2 * math.pi / frequencies
    smooth = np.clip((original / wavelengths - low) / (high - low), 0.0, 1.0)
    # smooth 0 (wavelength past original / low): factor; 1 (below original / high): 1
    return (1.0 / ((1 - smooth) / factor + smooth)).astype(np.float32)


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, n_vocab: int) -> None:
    """Byte-level BPE (GPT-2's, Llama 3's, Qwen's) as llama.cpp's ``gpt2`` tokenizer, or
    SentencePiece's BPE with byte fallback (Llama 2's, Gemma's) as its ``llama`` one."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    bpe = tokenizer["model"]
    pre = byte_level_pre_name(tokenizer)
    sentencepiece = is_sentencepiece_bpe(tokenizer)
    if bpe.get("type") != "BPE" or not (pre or sentencepiece):
        raise ExportError(
            f"{model_dir}: only byte-level BPE tokenizers (GPT-2's or SmolLM's "
            "pre-tokenizer) and SentencePiece's BPE with byte fallback are "
            "supported"
        )
    vocab: dict[str, int] = dict(bpe["vocab"])
    specials = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", []) if t["special"]}
    vocab.update(specials)
    if len(vocab) > n_vocab:
        raise ExportError(f"{model_dir}: tokenizer has {len(vocab)} tokens, model {n_vocab}")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, token_id in vocab.items():
        tokens[token_id] = text
        types[token_id] = gguf.TokenType.CONTROL if text in specials else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]

    if sentencepiece:
        _add_sentencepiece_vocab(writer, tokenizer, tokens, types, merges)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[settings["bos_token"]])
    writer.add_eos_token_id(vocab[settings["eos_token"]])
    writer.add_add_bos_token(adds_bos(settings, tokenizer))
    writer.add_add_eos_token(False)
    if settings.get("chat_template"):
        writer.add_chat_template(settings["chat_template"])


def _add_sentencepiece_vocab(
    writer: gguf.GGUFWriter, tokenizer: dict, tokens: list[str], types: list, merges: list[str]
) -> None:
    """llama.cpp's SentencePiece tokenizer merges the adjacent pair whose joined piece scores
    highest: a piece's score is minus the rank of the merge that makes it, so it merges in
    the BPE's order. ``<0xNN>`` pieces are bytes, the unknown piece is UNKNOWN."""
    scores = [0.0] * len(tokens)
    index = {text: token_id for token_id, text in enumerate(tokens)}
    for rank, merge in enumerate(merges):
        token_id = index.get(merge.replace(" ", ""))
        if token_id is not None and scores[token_id] == 0.0:  # its first (best) merge
            scores[token_id] = -float(rank + 1)
    unknown = tokenizer["model"].get("unk_token")
    for token_id, text in enumerate(tokens):
        if byte_piece(text) is not None:
            types[token_id] = gguf.TokenType.BYTE
        elif text == unknown:
            types[token_id] = gguf.TokenType.UNKNOWN
    normalizer = json.dumps(tokenizer.get("normalizer") or {})
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    # Llama 2's normalizer prepends a space to the text, Gemma's does not
    writer.add_add_space_prefix('"Prepend"' in normalizer)


def _tensor_type(
    gguf_name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType, head: str
) -> gguf.GGMLQuantizationType:
    """The type one tensor is stored in, for a file of ``qtype`` whose output head is ``head``."""
    if len(shape) == 1:  # llama.cpp keeps 1-D tensors (norms) in F32
        return gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.Q4_0 and gguf_name == head:
        # llama.cpp's quantizer keeps the output head at 6 bits (Q6_K, which gguf-py cannot
        # write); 4 bits there cost the most quality
        qtype = gguf.GGMLQuantizationType.Q8_0
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:  # block types need rows in whole blocks
        return gguf.GGMLQuantizationType.F32
    return qtype


def export_gguf(model_dir: Path, out_path: Path, out_type: str = "f16") -> Path:
    """Write ``out_path`` from the HF folder ``model_dir`` (``ARCHITECTURES``); returns it.

    Tensors stream one at a time, so memory stays near the largest tensor (in f32), not the
    model: a 1B model exports on a small machine.
    """
    if out_type not in OUT_TYPES:
        raise ExportError(f"unknown GGUF type {out_type!r}; choose one of {', '.join(OUT_TYPES)}")
    try:
        config = json.loads((model_dir / "config.json").read_text())
        handle = safe_open(model_dir / "model.safetensors", framework="numpy")
    except (OSError, json.JSONDecodeError, SafetensorError) as error:
        raise ExportError(f"{model_dir}: cannot read the model: {error}") from error
    with handle:
        if config.get("model_type") not in ARCHITECTURES:
            raise ExportError(
                f"{model_dir}: model_type {config.get('model_type')!r} is not "
                f"one of {', '.join(ARCHITECTURES)}"
            )
        _write(handle, config, model_dir, out_path, out_type)
    return out_path


def _add_shape(
    writer: gguf.GGUFWriter, config: dict, head_dim: int, rope_kind: str, rope: dict
) -> None:
    """The architecture's hyperparameters, as llama.cpp reads them."""
    n_heads = config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", n_heads))
    if head_dim != config["hidden_size"] // n_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope_kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config["model_type"] in GEMMA_TYPES:
        _add_gemma(writer, config)


def _add_gemma(writer: gguf.GGUFWriter, config: dict) -> None:
    """Gemma 2's and 3's settings: the sliding window and which layers use it (one flag a
    layer), Gemma 3's windowed layers' rotary base, the soft caps (Gemma 2's attention and
    logits; a Gemma 3 may cap its logits)."""
    model_type, heads = config["model_type"], config["num_attention_heads"]
    scalar = config.get("query_pre_attn_scalar")
    wide = config["num_hidden_layers"] == GEMMA_WIDE_QUERY_LAYERS[model_type]
    expected = (
        config["hidden_size"] // heads
        if wide
        else config.get("head_dim") or config["hidden_size"] // heads
    )
    if scalar is not None and scalar != expected:
        # llama.cpp derives the query scale from the shape (as for Google's released sizes)
        raise ExportError(f"query_pre_attn_scalar {scalar} is not the {expected} llama.cpp assumes")
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(float(config.get("attn_logit_softcapping") or 0.0))
        writer.add_final_logit_softcapping(float(config.get("final_logit_softcapping") or 0.0))
    else:
        if config.get("attn_logit_softcapping"):
            raise ExportError("attention logit softcapping is not Gemma 3's (llama.cpp's lacks it)")
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    kinds = config.get("layer_types") or []
    if config.get("sliding_window") and "sliding_attention" in kinds:
        writer.add_sliding_window(int(config["sliding_window"]))
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kinds])
        if model_type == "gemma3_text":
            _, local = _rope(config, "sliding_attention")
            writer.add_rope_freq_base_swa(float(local["rope_theta"]))


def _write(handle: safe_open, config: dict, model_dir: Path, out_path: Path, out_type: str) -> None:
    """Declare every tensor (the header lists them), then convert and write them one by one."""
    n_heads = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads", n_heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    architecture = config["model_type"]
    gemma = architecture in GEMMA_TYPES
    rope_kind, rope = _rope(config)
    qtype, file_type = OUT_TYPES[out_type]
    hf_names = list(handle.keys())
    # a tied model's embedding doubles as the output head
    head = "output.weight" if "lm_head.weight" in hf_names else "token_embd.weight"

    writer = gguf.GGUFWriter(out_path, GGUF_ARCHITECTURES[architecture])
    writer.add_name(config.get("_name_or_path") or model_dir.name)
    _add_shape(writer, config, head_dim, rope_kind, rope)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, model_dir, config["vocab_size"])

    def read(hf_name: str) -> Callable[[], np.ndarray]:
        def load() -> np.ndarray:
            data = handle.get_tensor(hf_name).astype(np.float32)
            if architecture == "llama" and ".q_proj." in hf_name:
                return rotary_rows_to_interleaved(data, n_heads)
            if architecture == "llama" and ".k_proj." in hf_name:
                return rotary_rows_to_interleaved(data, n_kv_heads)
            if gemma and hf_name.endswith("norm.weight"):
                return data + 1  # Gemma's norms scale by 1 + weight; llama.cpp's by weight
            return data

        return load

    # (GGUF name, shape, the data as float32 when its turn comes): one tensor in memory at once
    tensors = [
        (
            gguf_tensor_name(name, architecture),
            tuple(handle.get_slice(name).get_shape()),
            read(name),
        )
        for name in hf_names
    ]
    if rope_kind == "llama3":
        factors = llama3_frequency_factors(rope, head_dim)
        tensors.append(("rope_freqs.weight", factors.shape, lambda: factors))
    plan = []
    for gguf_name, shape, load in tensors:
        tensor_type = _tensor_type(gguf_name, shape, qtype, head)
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        nbytes = math.prod(shape[:-1]) * shape[-1] // block_size * type_size
        writer.add_tensor_info(gguf_name, shape, np.dtype(np.float32), nbytes, tensor_type)
        plan.append((load, tensor_type))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for load, tensor_type in plan:
            writer.write_tensor_data(gguf.quants.quantize(load(), tensor_type))
    finally:
        writer.close()


def export_any(model_dir: Path, out_path: Path, out_type: str, f16: Path | None = None) -> Path:
    """``export_gguf`` for its types; a K-quant (``QUANT_TYPES``) is llama.cpp's quantization of
    ``f16`` (an F16 export of the folder), or of a temporary one beside ``out_path``. Raises
    ExportError or QuantizeError."""
    if out_type not in QUANT_TYPES:
        return export_gguf(model_dir, out_path, out_type)
    temporary = f16 is None
    f16 = out_path.with_name(f".{out_path.name}.f16.tmp") if temporary else f16
    try:
        if temporary:
            export_gguf(model_dir, f16, "f16")
        return quantize_gguf(f16, out_path, out_type)
    finally:
        if temporary:
            f16.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.models.gguf_export")
    parser.add_argument("model_dir", type=Path, help="Hugging Face Llama model folder")
    parser.add_argument("out", type=Path, help="GGUF file to write")
    parser.add_argument(
        "--type",
        choices=[*sorted(OUT_TYPES), *QUANT_TYPES],
        default="f16",
        help="K-quants, IQ4: an F16 export quantized by llama.cpp",
    )
    args = parser.parse_args(argv)
    try:
        export_any(args.model_dir, args.out, args.type)
    except (ExportError, QuantizeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB, {args.type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

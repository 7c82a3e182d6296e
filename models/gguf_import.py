"""Import a GGUF file (llama.cpp's ``llama`` architecture, byte-level BPE vocabulary) as a
Hugging Face folder, so the torch runtime serves the same model the GGUF holds.

The GGUF's weights are the model: quantized tensors are dequantized to float32 exactly as
llama.cpp dequantizes them (``gguf.quants``), q/k rows go back from llama.cpp's rotation of
adjacent pairs to HF's rotation of halves, and a GGUF without ``output.weight`` becomes a
tied folder. The tokenizer is rebuilt from the GGUF's token list and merges with the
pre-tokenizer its ``tokenizer.ggml.pre`` names (only the ones reproduced exactly here;
another is refused by name). Needs numpy, safetensors, tokenizers and gguf; no torch.

    python -m hetspec.models.gguf_import MODEL.gguf OUT_FOLDER
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file

# tokenizer.ggml.pre -> tokenizer.json's pre-tokenizer (the regexes llama.cpp applies for it)
_BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}
PRE_TOKENIZERS = {
    "gpt-2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
    "smollm": {  # SmolLM's: every digit alone, then GPT-2's byte-level split
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    },
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_SPECIAL_TYPES = (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)


class GgufImportError(ValueError):
    """The GGUF is not one this importer reproduces exactly; the message says why."""


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def interleaved_rows_to_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of ``gguf_export.rotary_rows_to_interleaved``: per head, row 2i goes to
    row i of the first half and row 2i+1 to row i of the second half."""
    head_dim = weight.shape[0] // n_heads
    pairs = weight.reshape(n_heads, head_dim // 2, 2, -1)
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.ffn_up.weight` -> `model.layers.3.mlp.up_proj.weight`."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise GgufImportError(f"unexpected tensor {gguf_name!r} for llama.cpp's llama architecture")


def model_config(reader: gguf.GGUFReader, tied: bool) -> dict:
    """config.json for the GGUF's ``llama.*`` metadata."""
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise GgufImportError(
            f"architecture {architecture!r}: only llama.cpp's 'llama' "
            "(Llama, SmolLM2, TinyLlama) is imported"
        )

    def number(key: str, default=None):
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise GgufImportError(f"the GGUF has no llama.{key}")
        return value

    if _field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise GgufImportError("rotary scaling is not imported")
    heads = int(number("attention.head_count"))
    width = int(number("embedding_length"))
    vocab = len(_field(reader, "tokenizer.ggml.tokens", []))
    head_dim = int(number("rope.dimension_count", width // heads))
    if head_dim != width // heads:
        raise GgufImportError("a partial rotary dimension is not imported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": width,
        "intermediate_size": int(number("feed_forward_length")),
        "num_hidden_layers": int(number("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(number("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(number("context_length")),
        "rms_norm_eps": float(number("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(number("rope.freq_base", 10000.0)),
        "vocab_size": int(_field(reader, "llama.vocab_size", vocab)),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def model_tensors(reader: gguf.GGUFReader, config: dict) -> dict[str, np.ndarray]:
    """Every tensor as float32 in HF's names and layout."""
    tensors = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        values = values.reshape([int(n) for n in reversed(tensor.shape.tolist())])
        if ".self_attn.q_proj." in name:
            values = interleaved_rows_to_rotary(values, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            values = interleaved_rows_to_rotary(values, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(values)
    return tensors


def tokenizer_files(reader: gguf.GGUFReader) -> dict[str, dict]:
    """tokenizer.json, tokenizer_config.json and generation_config.json for the GGUF's
    byte-level BPE vocabulary."""
    kind = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GgufImportError(f"tokenizer {kind!r}: only byte-level BPE ('gpt2') is imported")
    if pre not in PRE_TOKENIZERS:
        raise GgufImportError(
            f"pre-tokenizer {pre!r} is not one this importer reproduces "
            f"({', '.join(PRE_TOKENIZERS)})"
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [merge.split(" ", 1) for merge in _field(reader, "tokenizer.ggml.merges", [])]
    specials = [i for i, kind in enumerate(types) if kind in _SPECIAL_TYPES]
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tokens[i],
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in specials
        ],
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {text: i for i, text in enumerate(tokens)},
            "merges": merges,
        },
    }
    settings = {
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
        "tokenizer_class": "GPT2Tokenizer",
        "clean_up_tokenization_spaces": False,
    }
    if template := _field(reader, "tokenizer.chat_template"):
        settings["chat_template"] = template
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    return {
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": settings,
        "generation_config.json": generation,
    }


def import_gguf(gguf_path: Path, out_folder: Path) -> Path:
    """Write ``out_folder`` (config.json, model.safetensors in float32, the tokenizer files)
    for ``gguf_path``, atomically: a folder that exists is complete. Raises
    ``GgufImportError`` for a GGUF this importer does not reproduce exactly, ``OSError`` for
    one it cannot read or a folder it cannot write."""
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, IndexError, KeyError) as error:  # gguf's own errors for a bad file
        raise GgufImportError(f"{gguf_path}: not a readable GGUF ({error})") from None
    names = {tensor.name for tensor in reader.tensors}
    config = model_config(reader, tied="output.weight" not in names)
    files = tokenizer_files(reader)
    tensors = model_tensors(reader, config)
    temp = out_folder.with_name(f".{out_folder.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    temp.mkdir(parents=True)
    try:
        (temp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, document in files.items():
            (temp / name).write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
        save_file(tensors, temp / "model.safetensors", metadata={"format": "pt"})
        (temp / "model.safetensors").chmod((temp / "config.json").stat().st_mode & 0o777)
        if out_folder.exists():
            shutil.rmtree(out_folder)
        temp.rename(out_folder)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return out_folder


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success, 1 when the GGUF cannot be imported or the folder written."""
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.models.gguf_import", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("gguf", type=Path, help="a llama-architecture GGUF file")
    parser.add_argument("out", type=Path, help="the Hugging Face folder to write")
    args = parser.parse_args(argv)
    try:
        import_gguf(args.gguf, args.out)
    except (GgufImportError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

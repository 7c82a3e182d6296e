"""A Gemma 3 of a released shape with random weights, as a model folder and a GGUF file, to
time the native kernels against llama.cpp on Gemma's real widths (no Gemma weights ship here).

    python -m hetspec.models.random_gemma3 270m /tmp/gemma3-270m --type q8_0
    python -m hetspec.workers.tools.profile native /tmp/gemma3-270m/model-q8_0.gguf
    python -m hetspec.workers.tools.profile llama.cpp /tmp/gemma3-270m/model-q8_0.gguf

Random weights predict nothing, but a forward costs what the released model's costs: the same
matrices, vocabulary (262,144 rows in the tied output head), head_dim 256 and windows of 512.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Google's released text shapes (config.json of gemma-3-270m and gemma-3-1b-pt)
SHAPES = {
    "270m": {
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
    },
    "1b": {
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
    },
}
COMMON = {
    "vocab_size": 262_144,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def write(shape: str, folder: Path, gguf_type: str) -> Path:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from hetspec.models.gguf_export import export_any  # noqa: PLC0415
    from hetspec.models.train_demo import train_tokenizer, write_tokenizer_files  # noqa: PLC0415

    folder.mkdir(parents=True, exist_ok=True)
    layers = SHAPES[shape]["num_hidden_layers"]
    kinds = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    config = transformers.AutoConfig.for_model(
        "gemma3_text",
        **COMMON,
        **SHAPES[shape],
        layer_types=kinds,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    texts = [Path(torch.__file__).read_text()]  # any text: the tokenizer only fills the file
    write_tokenizer_files(train_tokenizer(texts, 512), folder, config.max_position_embeddings)
    return export_any(folder, folder / f"model-{gguf_type}.gguf", gguf_type)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=SHAPES)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--type", default="q8_0", help="a GGUF type gguf_export writes")
    args = parser.parse_args()
    print(write(args.shape, args.folder, args.type))


if __name__ == "__main__":
    main()

"""What a model file says about itself: format, family, size, quantization, metadata.

Read from the file's header only (a GGUF's key-value metadata and tensor table, a
safetensors header and ``config.json``), never its weights, so it is cheap enough to answer
``/api/tags`` and ``/api/show`` and to check a pair before it is served.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from hetspec.protocol.gguf_header import SkippedStrings, read_gguf_header

# config.json's names for the numbers a GGUF stores as "{architecture}.{key}"
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "vocab_size": "vocab_size",
}
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class ModelFacts:
    path: str
    format: str  # "gguf" or "safetensors"
    family: str  # the architecture: "llama", "qwen2", ...
    parameters: int
    quantization: str  # "Q8_0", "Q4_0", "F16", "F32", "BF16", ...
    size_bytes: int  # on disk
    modified: datetime
    info: dict = field(default_factory=dict)  # GGUF-style metadata: "llama.context_length"...
    tensor_types: frozenset[str] = frozenset()  # a GGUF's tensors' ggml types: "Q4_K", "F32"...

    @property
    def parameter_size(self) -> str:
        """Ollama's form: "8.0B", "494.03M"."""
        if self.parameters >= 1e9:
            return f"{self.parameters / 1e9:.1f}B"
        return f"{self.parameters / 1e6:.2f}M"

    @property
    def context_length(self) -> int | None:
        """The trained context where the file states a positive whole number, else None."""
        value = self.info.get(f"{self.family}.context_length")
        return value if type(value) is int and value > 0 else None

    @property
    def digest(self) -> str:
        """An identity of the file (path, size, modification time), not a hash of its bytes:
        hashing gigabytes on every listing would take seconds."""
        stamp = f"{self.path}:{self.size_bytes}:{self.modified.timestamp()}"
        return hashlib.sha256(stamp.encode()).hexdigest()


def read_model_facts(path: str | Path) -> ModelFacts:
    """The facts of a GGUF file or a Hugging Face folder (config.json + safetensors);
    ``ValueError`` says what is missing or unreadable."""
    path = Path(path)
    if path.is_file():
        return _gguf_facts(path)
    if path.is_dir():
        return _folder_facts(path)
    raise ValueError(f"{path}: no such file or folder")


def _modified(*files: Path) -> datetime:
    return datetime.fromtimestamp(max(f.stat().st_mtime for f in files), UTC)


def _gguf_facts(path: Path) -> ModelFacts:
    from gguf import LlamaFileType  # noqa: PLC0415 - a heavy import

    try:
        header = read_gguf_header(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"{path}: not a readable GGUF file ({error})") from None
    # scalars and strings only: the vocabulary's arrays and the chat template are long
    info = {
        key: value
        for key, value in header.fields.items()
        if not key.startswith("tokenizer.") and not isinstance(value, list | SkippedStrings)
    }
    family = str(info.get("general.architecture", "unknown"))
    parameters = sum(tensor.n_elements for tensor in header.tensors.values())
    info["general.parameter_count"] = parameters
    file_type = info.get("general.file_type")
    try:
        quantization = LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        quantization = f"type {file_type}"
    tensor_types = frozenset(tensor.type_name for tensor in header.tensors.values())
    return ModelFacts(
        str(path),
        "gguf",
        family,
        parameters,
        quantization,
        path.stat().st_size,
        _modified(path),
        info,
        tensor_types,
    )


def _folder_facts(folder: Path) -> ModelFacts:
    from safetensors import safe_open  # noqa: PLC0415

    config_file = folder / "config.json"
    weights = sorted(folder.glob("*.safetensors"))
    if not config_file.is_file() or not weights:
        raise ValueError(f"{folder}: a model folder needs config.json and *.safetensors")
    try:
        config = json.loads(config_file.read_text())
        parameters = 0
        for file in weights:
            with safe_open(file, "np") as tensors:
                parameters += sum(
                    math.prod(tensors.get_slice(name).get_shape())
                    for name in tensors.keys()  # noqa: SIM118
                )
    except (ValueError, OSError) as error:
        raise ValueError(f"{folder}: unreadable model files ({error})") from None
    family = config.get("model_type", "unknown")
    info = {"general.architecture": family, "general.parameter_count": parameters}
    for key, name in CONFIG_KEYS.items():
        if isinstance(config.get(name), int):
            info[f"{family}.{key}"] = config[name]
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    return ModelFacts(
        str(folder),
        "safetensors",
        family,
        parameters,
        _DTYPES.get(dtype, dtype.upper()),
        sum(f.stat().st_size for f in weights),
        _modified(config_file, *weights),
        info,
    )

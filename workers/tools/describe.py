"""``python -m hetspec.workers.tools.describe {gguf|folder} PATH``: a model's vocabulary.

Prints exactly one JSON line on stdout, a ``hetspec.protocol.VocabReport``: the vocabulary
identity the worker would report after loading PATH (llama.cpp reads a GGUF's alone, no
weights; a folder's ``tokenizer.json`` is read as the torch worker reads it), or why it
cannot be read (exit 0 either way). A process of its own, so the daemon's side never imports
llama.cpp or torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from hetspec.protocol import VocabReport


def _gguf_vocab(path: Path) -> VocabReport:
    from hetspec.workers.runtimes.llama_cpp_runtime.vocabulary import VocabularyFile  # noqa: PLC0415

    vocabulary = VocabularyFile.open(path)
    if vocabulary is None:
        return VocabReport(str(path), error="llama.cpp cannot load this file's vocabulary")
    try:
        return VocabReport(str(path), vocab=vocabulary.info())
    finally:
        vocabulary.close()


def _folder_vocab(folder: Path) -> VocabReport:
    from hetspec.workers.runtimes.torch_runtime.tokenizer import FolderTokenizer  # noqa: PLC0415

    config = json.loads((folder / "config.json").read_text())
    tokenizer = FolderTokenizer(folder, int(config["vocab_size"]))
    return VocabReport(str(folder), vocab=tokenizer.vocab_info())


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("gguf", "folder"):
        print("usage: python -m hetspec.workers.tools.describe {gguf|folder} PATH", file=sys.stderr)
        return 2
    kind, path = argv[0], Path(argv[1])
    try:
        report = _gguf_vocab(path) if kind == "gguf" else _folder_vocab(path)
    except Exception as error:
        report = VocabReport(str(path), error=f"{type(error).__name__}: {error}")
    sys.stdout.buffer.write(msgspec.json.encode(report) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

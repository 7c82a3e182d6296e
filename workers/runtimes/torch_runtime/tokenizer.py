"""The tokenizer of a Hugging Face model folder, reported the way llama.cpp reports a GGUF's.

The daemon compares the draft's and the target's vocabularies by fingerprint, and detokenizes
by concatenating each token's bytes; so a torch worker must describe its ``tokenizer.json``
exactly as the llama.cpp worker describes the same vocabulary exported to GGUF: the raw vocab
text of every id (byte-level BPE keeps GPT-2's byte-to-unicode spelling, "Ġthe"), BOS/EOS and
add-BOS from ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer

from hetspec.protocol.tokenizer_files import (
    END_OF_TURN_TEXTS,
    adds_bos,
    byte_piece,
    generation_end_ids,
    is_byte_level,
    is_sentencepiece_bpe,
)
from hetspec.protocol.vocab import VocabInfo
from hetspec.speculative.drafting.vocab_match import vocab_info
from hetspec.workers.runtimes.torch_runtime.config import ModelLoadError

KINDS = {"BPE": "bpe", "Unigram": "ugm", "WordPiece": "wpm"}


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable spelling of each byte, inverted (what byte-level BPE vocabularies use)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            spelled.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, spelled, strict=True)}


class FolderTokenizer:
    def __init__(self, folder: str | Path, vocab_size: int) -> None:
        folder = Path(folder)
        try:
            self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            spec = json.loads((folder / "tokenizer.json").read_text())
            settings_path = folder / "tokenizer_config.json"
            settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
            generation_path = folder / "generation_config.json"
            generation = json.loads(generation_path.read_text()) if generation_path.exists() else {}
        except (OSError, ValueError, Exception) as error:  # tokenizers raises plain Exception
            raise ModelLoadError(f"{folder}: cannot read its tokenizer files ({error})") from None
        model_type = spec.get("model", {}).get("type", "")
        self.byte_level = is_byte_level(spec)
        self.sentencepiece = is_sentencepiece_bpe(spec)
        self.kind = (
            "spm" if self.sentencepiece else KINDS.get(model_type, model_type.lower() or "unknown")
        )
        self.vocab_size = vocab_size
        self.specials = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self.bos = self._special_id(settings.get("bos_token"))
        self.eos = self._special_id(settings.get("eos_token"))
        self.add_bos = adds_bos(settings, spec) and self.bos >= 0
        marked = (self._tokenizer.token_to_id(text) for text in END_OF_TURN_TEXTS)
        listed = {*generation_end_ids(generation), *(i for i in marked if i is not None)}
        self.ends = sorted(i for i in listed if 0 <= i < vocab_size)

    def _special_id(self, token: str | dict | None) -> int:
        if isinstance(token, dict):
            token = token.get("content")
        token_id = self._tokenizer.token_to_id(token) if token else None
        return -1 if token_id is None else token_id

    def texts(self) -> list[bytes]:
        """The vocab text of every id; ids past the tokenizer's end are exporters' padding."""
        texts = []
        for token_id in range(self.vocab_size):
            text = self._tokenizer.id_to_token(token_id)
            texts.append(f"[PAD{token_id}]".encode() if text is None else text.encode())
        return texts

    def vocab_info(self) -> VocabInfo:
        return vocab_info(self.kind, self.texts(), self.bos, self.eos, self.add_bos, ends=self.ends)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a special renders as its text)."""
        text = self._tokenizer.id_to_token(token_id)
        if text is None:
            return b""
        if token_id in self.specials or not self.byte_level:
            if self.sentencepiece and token_id not in self.specials:
                byte = byte_piece(text)
                if byte is not None:
                    return bytes([byte])
            return text.replace("\u2581", " ").encode()  # SentencePiece's visible space
        decoder = _byte_decoder()
        return bytes(decoder[char] for char in text if char in decoder)

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """``text``'s ids (special tokens' text parsed), with BOS first when ``add_special``
        and the model adds one (``add_bos``), as llama.cpp tokenizes the model's GGUF."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos, *ids] if add_special and self.add_bos else ids

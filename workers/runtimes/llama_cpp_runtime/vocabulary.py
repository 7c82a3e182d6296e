"""A GGUF file's vocabulary through llama.cpp: what the llama.cpp runtime tokenizes with, and
what the native runtime loads alone (``vocab_only``) so both tokenize identically."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as L

from hetspec.speculative.drafting.vocab_match import VocabInfo, vocab_info
from hetspec.workers.runtimes.llama_cpp_runtime.log import LlamaLog, llama_log

VOCAB_KINDS = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}


class Vocabulary:
    """Tokenizing and detokenizing with a loaded llama.cpp model's vocabulary."""

    def __init__(self, model: L.llama_model_p) -> None:
        self._vocab = L.llama_model_get_vocab(model)
        self.size = L.llama_vocab_n_tokens(self._vocab)

    def info(self) -> VocabInfo:
        texts = [L.llama_vocab_get_text(self._vocab, i) or b"" for i in range(self.size)]
        return vocab_info(
            VOCAB_KINDS.get(L.llama_vocab_type(self._vocab), "unknown"),
            texts,
            L.llama_vocab_bos(self._vocab),
            L.llama_vocab_eos(self._vocab),
            bool(L.llama_vocab_get_add_bos(self._vocab)),
            ends=[i for i in range(self.size) if L.llama_vocab_is_eog(self._vocab, i)],
        )

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; special-token markup (``<|im_start|>``) is parsed."""
        data = text.encode()
        capacity = len(data) + 8
        while True:
            buffer = (L.llama_token * capacity)()
            count = L.llama_tokenize(
                self._vocab, data, len(data), buffer, capacity, add_special, True
            )
            if count >= 0:
                return list(buffer[:count])
            capacity = -count

    def special_tokens(self) -> list[int]:
        """The control tokens (``<|im_end|>``, ``<|endoftext|>``): markup, not text."""
        return [i for i in range(self.size) if L.llama_vocab_is_control(self._vocab, i)]

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (specials rendered), for incremental detokenizing."""
        buffer = ctypes.create_string_buffer(64)
        count = L.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, True)
        if count < 0:
            buffer = ctypes.create_string_buffer(-count)
            count = L.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, True)
        return buffer.raw[:count]


class VocabularyFile(Vocabulary):
    """The vocabulary of a GGUF file alone: llama.cpp loads no weights. ``None`` from
    ``open`` means llama.cpp refused the file."""

    def __init__(self, model: L.llama_model_p, log: LlamaLog) -> None:
        super().__init__(model)
        self._model = model
        self._log = log  # llama.cpp's log goes here, not to stderr, while this lives

    @classmethod
    def open(cls, path: str | Path) -> VocabularyFile | None:
        log = llama_log()
        L.llama_backend_init()
        params = L.llama_model_default_params()
        params.vocab_only = True
        # no devices: by default llama.cpp asks every registered one for its memory, and an
        # rpc-server registered earlier in this process that has gone aborts the process
        no_devices = (ctypes.c_void_p * 1)(None)
        params.devices = ctypes.cast(no_devices, ctypes.c_void_p)
        model = L.llama_model_load_from_file(str(path).encode(), params)
        return cls(model, log) if model else None

    def close(self) -> None:
        if getattr(self, "_model", None):
            L.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()

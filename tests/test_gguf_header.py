"""protocol/gguf_header.py reads what gguf-py's reader reads, from the same bytes."""

from __future__ import annotations

import struct
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest
from tiny_models import write_tiny_gguf

from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.protocol.gguf_header import GGUFFormatError, SkippedStrings, read_gguf_header


def files(tmp_path):
    return [
        BUNDLED_MODELS / "target" / "target-q8_0.gguf",
        BUNDLED_MODELS / "draft" / "draft-q8_0.gguf",
        write_tiny_gguf(tmp_path / "gemma3", "gemma3", gguf_type="q8_0", intermediate_size=128),
        write_tiny_gguf(tmp_path / "qwen3", "qwen3", gguf_type="f32", intermediate_size=128),
    ]


def test_fields_and_tensors_are_gguf_pys(tmp_path) -> None:
    for path in files(tmp_path):
        reference = gguf.GGUFReader(path)
        header = read_gguf_header(path, strings=True)
        skipped = read_gguf_header(path)
        expected = {
            k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")
        }
        assert header.fields == expected, path
        for key, value in expected.items():
            if isinstance(value, list) and value and isinstance(value[0], str):
                assert skipped.fields[key] == SkippedStrings(len(value))
            else:
                assert skipped.fields[key] == value
        assert list(header.tensors) == [t.name for t in reference.tensors]
        for tensor in reference.tensors:
            info = header.tensors[tensor.name]
            assert info.shape == tuple(int(n) for n in tensor.shape)
            assert info.type == int(tensor.tensor_type)
            assert info.n_elements == int(tensor.n_elements)
            assert info.offset == int(tensor.data_offset)
            assert info.nbytes == int(tensor.n_bytes)
            data = header.tensor_data(info)
            np.testing.assert_array_equal(data, tensor.data)
            assert data.dtype == tensor.data.dtype
            assert data.shape == tensor.data.shape


@pytest.mark.slow
def test_a_large_vocabulary_reads_in_a_fraction_of_gguf_pys_time(tmp_path) -> None:
    """A 262,144-token vocabulary (Gemma 3's): gguf-py builds a view per token."""
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list([f"token-{i}" for i in range(262_144)])
    writer.add_token_types([1] * 262_144)
    writer.add_tensor("x", np.zeros(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    began = time.perf_counter()
    header = read_gguf_header(path)
    ours = time.perf_counter() - began
    assert header.fields["tokenizer.ggml.tokens"] == SkippedStrings(262_144)
    assert len(header.fields["tokenizer.ggml.token_type"]) == 262_144
    assert (
        read_gguf_header(path, strings=True).fields["tokenizer.ggml.tokens"][-1] == "token-262143"
    )
    began = time.perf_counter()
    gguf.GGUFReader(path)
    theirs = time.perf_counter() - began
    assert ours < theirs / 5, (ours, theirs)


def test_files_that_are_not_gguf_are_refused_with_a_reason(tmp_path) -> None:
    cases = {
        b"": "no GGUF magic",
        b"GGML" + bytes(20): "no GGUF magic",
        b"GGUF" + (7).to_bytes(4, "little") + bytes(16): "GGUF version 7",
    }
    good = (BUNDLED_MODELS / "draft" / "draft-q8_0.gguf").read_bytes()
    cases[good[:5000]] = "ends early|runs past the end"
    for index, (content, reason) in enumerate(cases.items()):
        path = tmp_path / f"bad-{index}.gguf"
        path.write_bytes(content)
        with pytest.raises(GGUFFormatError, match=reason):
            read_gguf_header(path)


def crafted(fields: bytes, field_count: int, tensors: bytes = b"", tensor_count: int = 0) -> bytes:
    """A GGUF v3 header of raw key-value and tensor-info bytes."""
    head = b"GGUF" + struct.pack("<IQQ", 3, tensor_count, field_count)
    return head + fields + tensors


def key(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


@pytest.mark.process
def test_crafted_headers_are_refused_in_one_line_not_a_crash(tmp_path) -> None:
    """Arrays nested 5,000 deep (a RecursionError traceback in models check once) and a
    tensor of 2**32 x 2**32 values (np.prod wrapped it to 0 bytes, which passed the
    end-of-file check) are refused by name."""
    depth = 5000
    nested = key("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth
    nested += struct.pack("<IQ", 4, 0)  # the innermost: no uint32s
    huge = key("blk.0.attn_q.weight") + struct.pack("<IQQIQ", 2, 2**32, 2**32, 0, 0)
    cases = {
        "nested": (crafted(nested, 1), "nested more than 8 deep"),
        "huge": (crafted(b"", 0, huge, 1), "runs past the end of the file"),
    }
    for name, (content, reason) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content + bytes(64))
        with pytest.raises(GGUFFormatError, match=reason):
            read_gguf_header(path)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "hetspec.client.cli",
                "models",
                "check",
                str(path),
                str(BUNDLED_MODELS / "draft" / "draft-q8_0.gguf"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert reason in done.stderr

"""SentencePiece vocabularies (Llama 2's, Gemma's) as both sides of the daemon see them.

A Gemma model comes as a Hugging Face folder (the torch runtime reads its tokenizer.json: a
BPE with byte fallback, transformers' conversion of the SentencePiece model) and as a GGUF
(llama.cpp and the native kernels read llama.cpp's "spm" vocabulary). The daemon pairs a
torch target with a GGUF draft only when both describe one vocabulary, and writes text from
the target's bytes per token: both must agree with llama.cpp's, byte pieces included.
"""

from __future__ import annotations

import json

import pytest
from tiny_models import write_tiny_gguf

from hetspec.speculative.drafting.vocab_match import incompatibilities
from hetspec.workers.runtimes.llama_cpp_runtime.vocabulary import VocabularyFile
from hetspec.workers.runtimes.torch_runtime.tokenizer import FolderTokenizer

TEXTS = [
    "def f(x):\n    return x + 1  # ünïcode ☃",  # characters only byte pieces spell
    " leading space, then\ttab",
    "import json\nfrom glob import glob\n\n\nclass A:\n    pass\n",
]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-spm")
    path = write_tiny_gguf(folder, "gemma3", sentencepiece=True)
    return folder, path


@pytest.fixture(scope="module")
def llama2(tmp_path_factory):
    """Llama 2's layout: a space put before the text (llama.cpp's add_space_prefix)."""
    folder = tmp_path_factory.mktemp("llama2-spm")
    path = write_tiny_gguf(folder, sentencepiece="prefix-space")
    return folder, path


@pytest.mark.parametrize("model", ["gemma", "llama2"])
def test_the_folder_and_llama_cpp_describe_one_vocabulary(request, model) -> None:
    folder, path = request.getfixturevalue(model)
    theirs = VocabularyFile.open(path)
    ours = FolderTokenizer(folder, theirs.size)
    assert ours.kind == theirs.info().kind == "spm"
    assert incompatibilities(theirs.info(), ours.vocab_info()) == []
    assert [ours.token_bytes(i) for i in range(theirs.size)] == [
        theirs.token_bytes(i) for i in range(theirs.size)
    ]
    byte_piece = ours.tokenize("<0x0A>", add_special=False)  # the text, not the piece
    assert ours.token_bytes(ours._tokenizer.token_to_id("<0x0A>")) == b"\n"
    prefix = b" " if model == "llama2" else b""
    assert b"".join(ours.token_bytes(i) for i in byte_piece) == prefix + b"<0x0A>"
    for text in TEXTS:
        assert ours.tokenize(text) == theirs.tokenize(text), text
        pieces = b"".join(ours.token_bytes(i) for i in ours.tokenize(text)[1:])
        assert pieces == prefix + text.encode()


@pytest.mark.process
def test_the_daemon_pairs_a_torch_gemma_target_with_a_gguf_draft(tmp_path, gemma) -> None:
    """Torch verifies the folder, llama.cpp drafts from a GGUF of the same vocabulary: the
    daemon starts, speculation returns the target alone's tokens, and the text is the
    tokens' own (byte pieces joined into characters)."""
    from test_lossless import BundledDaemon  # noqa: PLC0415

    target_folder, target = gemma
    draft = write_tiny_gguf(tmp_path / "draft", "gemma3", seed=1, sentencepiece=True)
    settings = ["--set", 'cpu_runtime="llama.cpp"']
    for role, path in (("target", target), ("draft", draft)):
        settings += [
            "--set",
            f"{role}.gguf={json.dumps(str(path))}",
            "--set",
            f"{role}.folder={json.dumps(str(path.parent))}",
        ]
    daemon = BundledDaemon(tmp_path, "draft-cpu", *settings)
    try:
        tokenizer = FolderTokenizer(target_folder, VocabularyFile.open(target).size)
        options = {"max_tokens": 24, "ignore_eos": True}
        prompt = TEXTS[0]
        alone = daemon.generate(prompt, mode="autoregressive", **options)
        body = daemon.generate(prompt, mode="sequential", gamma=3, **options)
        assert body["tokens"] == alone["tokens"]
        assert body["timings"]["draft_n"] > 0
        expected = b"".join(tokenizer.token_bytes(i) for i in body["tokens"])
        assert body["response"] == expected.decode(errors="replace")
    finally:
        daemon.stop()

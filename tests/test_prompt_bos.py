"""One BOS before every prompt, whichever file says so and whoever tokenizes.

Llama 3's folders say they add BOS only through tokenizer.json's post-processor (no
``add_bos_token`` in tokenizer_config.json), and Gemma's and Llama 3's chat templates write the
BOS text themselves: the torch worker, llama.cpp over the exported GGUF and the daemon's chat
template must still agree on exactly one BOS.
"""

from __future__ import annotations

import json
import shutil

import pytest
from tiny_models import write_tiny_gguf

from hetspec.daemon.api.chat_template import ChatMessage, load_chat_template
from hetspec.models.gguf_export import export_gguf
from hetspec.protocol.tokenizer_files import adds_bos
from hetspec.speculative.drafting.vocab_match import incompatibilities
from hetspec.workers.runtimes.llama_cpp_runtime.vocabulary import VocabularyFile
from hetspec.workers.runtimes.torch_runtime.tokenizer import FolderTokenizer

# Gemma's template, abridged: BOS text first, turns as <start_of_turn>role ... <end_of_turn>
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) "
    "+ '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
LLAMA3_PROCESSOR = {  # as Llama 3.x's tokenizer.json has it (ids shortened)
    "type": "Sequence",
    "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False},
        {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [],
            "special_tokens": {},
        },
    ],
}


def test_who_adds_bos_is_read_from_either_file() -> None:
    llama3 = {"post_processor": LLAMA3_PROCESSOR}
    assert adds_bos({"bos_token": "<|begin_of_text|>"}, llama3)
    assert not adds_bos({"bos_token": "<|begin_of_text|>", "add_bos_token": False}, llama3)
    assert adds_bos({"bos_token": {"content": "<bos>"}, "add_bos_token": True}, None)
    assert not adds_bos({"bos_token": "<s>"}, llama3)  # the template starts with another token
    assert not adds_bos({}, {"post_processor": None})


@pytest.fixture(scope="module")
def llama3_style(tmp_path_factory):
    """A tiny model whose tokenizer_config.json does not say add_bos_token (its tokenizer.json
    post-processor adds BOS), exported to GGUF from that folder."""
    folder = tmp_path_factory.mktemp("llama3-style")
    write_tiny_gguf(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    del settings["add_bos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder, export_gguf(folder, folder / "model-no-key.gguf", "f32")


def test_a_bos_said_only_by_the_post_processor_is_one_bos_on_both_sides(llama3_style) -> None:
    folder, gguf = llama3_style
    theirs = VocabularyFile.open(gguf)
    ours = FolderTokenizer(folder, theirs.size)
    assert ours.add_bos
    assert incompatibilities(theirs.info(), ours.vocab_info()) == []
    text = "import json\n"
    assert ours.tokenize(text) == theirs.tokenize(text)
    assert ours.tokenize(text)[:2].count(ours.bos) == 1
    assert ours.tokenize(text, add_special=False) == theirs.tokenize(text, add_special=False)


@pytest.mark.parametrize("sentencepiece", [False, True], ids=["byte-level", "sentencepiece"])
def test_a_template_that_writes_bos_gets_one_bos(tmp_path, sentencepiece) -> None:
    folder = tmp_path / "gemma3"
    gguf = write_tiny_gguf(folder, "gemma3", sentencepiece=sentencepiece)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["chat_template"] = GEMMA_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    template = load_chat_template(folder)
    prompt = template.render([ChatMessage(role="user", content=" hi ")])
    bos = settings["bos_token"]
    assert prompt == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    theirs = VocabularyFile.open(gguf)
    for tokens in (FolderTokenizer(folder, theirs.size).tokenize(prompt), theirs.tokenize(prompt)):
        assert tokens[0] == theirs.info().bos
        assert tokens[1] != tokens[0]
    # where the tokenizer adds no BOS, the template's own BOS text stays
    settings["add_bos_token"] = False
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    kept = load_chat_template(folder).render([ChatMessage(role="user", content="hi")])
    assert kept.startswith(bos)
    shutil.rmtree(folder)

"""Generation ends at any of the target's end ids, not only its EOS.

Instruction models end a turn with a token of their own (<end_of_turn>, <|eot_id|>,
<|im_end|>); Gemma's list it beside <eos> in generation_config.json. llama.cpp stops at all
of them (its end-of-generation set); so does the daemon, whichever runtime verifies.
"""

from __future__ import annotations

import json

import pytest
from tiny_models import write_tiny_gguf

from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.daemon.decode.requests import cut_at_end
from hetspec.protocol.tokenizer_files import generation_end_ids
from hetspec.workers.runtimes.llama_cpp_runtime.vocabulary import VocabularyFile
from hetspec.workers.runtimes.torch_runtime.tokenizer import FolderTokenizer


def test_the_folder_and_llama_cpp_end_generation_at_the_same_ids() -> None:
    target = BUNDLED_MODELS / "target"
    theirs = VocabularyFile.open(next(target.glob("*q8_0.gguf"))).info()
    ours = FolderTokenizer(target, theirs.size).vocab_info()
    assert ours.ends == theirs.ends
    im_end = FolderTokenizer(target, theirs.size)._tokenizer.token_to_id("<|im_end|>")
    assert set(ours.ends) == {ours.eos, im_end}


def test_end_ids_come_from_generation_config_as_a_number_or_a_list() -> None:
    assert generation_end_ids({"eos_token_id": [1, 106]}) == [1, 106]
    assert generation_end_ids({"eos_token_id": 2}) == [2]
    assert generation_end_ids({"eos_token_id": None}) == []
    assert generation_end_ids({"eos_token_id": True}) == []
    assert cut_at_end([5, 6, 106, 7], frozenset({1, 106})) == ([5, 6], True)
    assert cut_at_end([5, 6], frozenset({1, 106})) == ([5, 6], False)


@pytest.mark.process
def test_the_daemon_stops_at_an_end_id_generation_config_lists(tmp_path) -> None:
    """A torch target whose generation_config.json lists a token the text reaches: every
    mode stops right before it, where it ran on before the file said so."""
    from test_lossless import BundledDaemon  # noqa: PLC0415

    models = {
        "target": write_tiny_gguf(tmp_path / "target", seed=0, layers=2),
        "draft": write_tiny_gguf(tmp_path / "draft", seed=1, layers=1),
    }
    settings = ["--set", 'cpu_runtime="llama.cpp"']
    for role, path in models.items():
        settings += [
            "--set",
            f"{role}.gguf={json.dumps(str(path))}",
            "--set",
            f"{role}.folder={json.dumps(str(path.parent))}",
        ]
    prompt, options = "import json\n", {"max_tokens": 24}
    for run in ("before", "after"):
        (tmp_path / run).mkdir()
    daemon = BundledDaemon(tmp_path / "before", "draft-cpu", *settings)
    try:
        before = daemon.generate(prompt, mode="autoregressive", **options)["tokens"]
    finally:
        daemon.stop()
    cut = next(i for i in range(3, len(before)) if before[i] not in before[:i])
    eos = FolderTokenizer(tmp_path / "target", 320).eos
    generation = {"eos_token_id": [eos, before[cut]]}
    (tmp_path / "target" / "generation_config.json").write_text(json.dumps(generation))
    daemon = BundledDaemon(tmp_path / "after", "draft-cpu", *settings)
    try:
        for mode in (
            {"mode": "autoregressive"},
            {"mode": "sequential", "gamma": 4},
            {"mode": "adaptive"},
        ):
            body = daemon.generate(prompt, **options, **mode)
            assert body["tokens"] == before[:cut], mode
            assert body["done_reason"] == "stop", mode
            ignored = daemon.generate(prompt, **options, **mode, ignore_eos=True)
            assert ignored["tokens"][: cut + 1] == before[: cut + 1], mode
    finally:
        daemon.stop()

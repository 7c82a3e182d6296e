"""protocol/gguf_checks.py (#70, 3-4): a GGUF whose metadata contradicts its tensors is refused
in one line, the same line, by ``hetspec models check``, the daemon at start-up and both
loaders (the native kernels', llama.cpp's), before any of them allocates by the file's numbers;
and 1,000 seeded crafted headers are each served or refused alike by the daemon and models
check, in one line, in bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf_crafting import RawGGUF, T, crafted_copy
from gguf_fuzz import BASES, apply, draw_mutations

from hetspec.daemon.config import BUNDLED_MODELS, DaemonConfig, ModelPaths
from hetspec.daemon.supervision.supervisor import StartupError, check_model_files
from hetspec.native.model import NativeModel
from hetspec.protocol.gguf_checks import GGUFMetadataError, check_model, check_model_file
from hetspec.protocol.gguf_header import read_gguf_header
from hetspec.workers.runtimes.llama_cpp_runtime.runtime import LlamaCppRuntime

DRAFT = BUNDLED_MODELS / "draft" / "draft-q8_0.gguf"  # 2 blocks, width 128, 4 heads of 32
MiB = 2**20

# the issue's reproductions (and item 4's string for a number): fields set -> the one line
REPRODUCTIONS = {
    "block_count": (
        {"llama.block_count": (T.UINT32, 2**28)},
        "llama.block_count is 268435456 but the file has 2 blocks of tensors (blk.0 to blk.1)",
    ),
    "key_length": (
        {
            "llama.attention.key_length": (T.UINT32, 2**17),
            "llama.rope.dimension_count": (T.UINT32, 2**17),
        },
        "blk.0.attn_q.weight has shape (128, 128), not (128, 524288) as the metadata "
        "says (llama.embedding_length 128, head_count 4 x key_length 131072)",
    ),
    "head_count": (
        {"llama.attention.head_count": (T.UINT32, 0)},
        "llama.attention.head_count is 0",
    ),
    "head_count_kv": (
        {"llama.attention.head_count_kv": (T.UINT32, 0)},
        "llama.attention.head_count_kv is 0",
    ),
    "feed_forward_length": (
        {"llama.feed_forward_length": (T.UINT32, 320)},
        "blk.0.ffn_gate.weight has shape (128, 352), not (128, 320) as the "
        "metadata says (llama.embedding_length 128, feed_forward_length 320)",
    ),
    "epsilon": (
        {"llama.attention.layer_norm_rms_epsilon": (T.STRING, "abc")},
        "llama.attention.layer_norm_rms_epsilon is 'abc' (string), where llama.cpp reads a float32",
    ),
}


def models_check(target: Path, draft: Path = DRAFT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetspec.client.cli", "models", "check", str(target), str(draft)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def refusal(call) -> str:
    """The one line ``call`` refuses with (any exception: the test says which it expected)."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


@pytest.mark.process
@pytest.mark.parametrize("case", sorted(REPRODUCTIONS))
def test_a_reproduction_is_refused_in_the_same_line_by_every_party(case, tmp_path) -> None:
    """Before the check: 2**28 blocks took the native loader 2.1 GB, then MemoryError (and
    llama.cpp aborted); 2**17-wide heads took 3.2 GB of RoPE tables; 0 heads raised
    ZeroDivisionError, 0 KV heads loaded; the string "could not convert string to float"; and
    models check said "can serve" (exit 0) of each."""
    values, reason = REPRODUCTIONS[case]
    path = crafted_copy(DRAFT, tmp_path / f"{case}.gguf", values)
    line = f"{path}: {reason}"
    assert refusal(lambda: check_model_file(path)) == f"GGUFMetadataError: {line}"
    assert refusal(lambda: NativeModel(path)) == f"ModelFormatError: {line}"
    assert refusal(lambda: LlamaCppRuntime(path, threads=1)) == f"LlamaCppError: {line}"
    config = DaemonConfig(target=ModelPaths(gguf=str(path)), draft=ModelPaths(gguf=str(DRAFT)))
    assert refusal(lambda: check_model_files(config)) == f"StartupError: {line}"
    done = models_check(path)
    assert (done.returncode, done.stdout) == (1, ""), done.stdout + done.stderr
    assert done.stderr == f"hetspec models check: cannot serve: {line}\n"


@pytest.mark.process
def test_the_native_loader_refuses_before_it_allocates(tmp_path) -> None:
    """The two reproductions that allocated gigabytes, loaded in a process of their own: its
    peak RSS stays under twice the file's size plus 256 MB."""
    paths = [
        crafted_copy(DRAFT, tmp_path / f"{case}.gguf", REPRODUCTIONS[case][0])
        for case in ("block_count", "key_length")
    ]
    code = (
        "import sys\n"
        "from gguf_fuzz import peak_rss\n"
        "from hetspec.native.model import ModelFormatError, NativeModel\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        NativeModel(path)\n"
        "    except ModelFormatError:\n"
        "        pass\n"
        "print(peak_rss())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parent,
    )
    peak = int(done.stdout)
    assert peak < 2 * DRAFT.stat().st_size + 256 * MiB, peak / MiB


@pytest.mark.process
def test_the_daemon_refuses_at_start_before_any_worker_loads(tmp_path) -> None:
    """hetspecd exits 1 within seconds, logging the line, with no worker started (it measured
    runtimes in profile workers first, where llama.cpp aborted on 2**28 blocks)."""
    values, reason = REPRODUCTIONS["block_count"]
    path = crafted_copy(DRAFT, tmp_path / "blocks.gguf", values)
    settings = {
        "target.gguf": str(path),
        "target.folder": "",
        "draft.gguf": str(DRAFT),
        "draft.folder": "",
    }
    argv = [
        sys.executable,
        "-m",
        "hetspec.daemon",
        "--socket",
        str(tmp_path / "s.sock"),
        "--runtime-dir",
        str(tmp_path / "run"),
        "--log-format",
        "json",
    ]
    for key, value in settings.items():
        argv += ["--set", f"{key}={json.dumps(value)}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSPEC_")}
    began = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - began < 30
    events = [json.loads(line) for line in done.stderr.splitlines()]
    refused = [e for e in events if e["event"] == "cannot serve"]
    assert [e["error"] for e in refused] == [f"{path}: {reason}"]
    assert [e["event"] for e in events] == ["starting", "cannot serve", "stopped"]


def test_bundled_and_mixture_of_experts_files_pass_and_others_are_left_to_llama_cpp(
    tmp_path,
) -> None:
    for path in (
        DRAFT,
        BUNDLED_MODELS / "target" / "target-q8_0.gguf",
        BUNDLED_MODELS / "smollm2-draft" / "draft-q8_0.gguf",
    ):
        shape = check_model_file(path)
        assert shape is not None
        assert shape.experts == 0
    # Mixtral is a llama with ffn_*_exps tensors instead of ffn_gate/up/down: not refused here
    raw = RawGGUF.read(DRAFT)
    raw.set("llama.expert_count", T.UINT32, 4)
    for index, tensor in enumerate(raw.tensors):
        if ".ffn_" in tensor.name and "norm" not in tensor.name:
            name = tensor.name.replace(".weight", "_exps.weight")
            raw.tensors[index] = type(tensor)(name, tensor.dims, tensor.type, tensor.offset)
    assert check_model_file(raw.write(tmp_path / "experts.gguf")).experts == 4
    # an architecture not checked here: llama.cpp's to judge, whatever its numbers
    other = RawGGUF.read(DRAFT).set("general.architecture", T.STRING, "phi3")
    other.set("phi3.block_count", T.STRING, "lots")
    assert check_model_file(other.write(tmp_path / "phi3.gguf")) is None
    # ... but any file must name its architecture, and have a vocabulary to serve
    unnamed = RawGGUF.read(DRAFT).drop("general.architecture").write(tmp_path / "unnamed.gguf")
    with pytest.raises(GGUFMetadataError, match=r"lacks general\.architecture$"):
        check_model(read_gguf_header(unnamed))
    silent = crafted_copy(
        DRAFT, tmp_path / "none.gguf", {"tokenizer.ggml.model": (T.STRING, "none")}
    )
    with pytest.raises(GGUFMetadataError, match=r"tokenizer\.ggml\.model is 'none'"):
        check_model_file(silent)


def test_check_model_files_names_an_unreadable_file(tmp_path) -> None:
    config = DaemonConfig(
        target=ModelPaths(gguf=str(tmp_path / "absent.gguf")), draft=ModelPaths(gguf=str(DRAFT))
    )
    with pytest.raises(StartupError, match=r"absent\.gguf: cannot read it \(No such file"):
        check_model_files(config)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGML" + bytes(60))
    config = DaemonConfig(target=ModelPaths(gguf=str(DRAFT)), draft=ModelPaths(gguf=str(junk)))
    with pytest.raises(StartupError, match=r"junk\.gguf: not a GGUF file \(no GGUF magic\)$"):
        check_model_files(config)


FUZZ_SEED, FUZZ_FILES = 70, 1000


@pytest.mark.slow
@pytest.mark.process
def test_fuzzed_headers_are_served_or_refused_alike_in_one_line(tmp_path) -> None:
    """1,000 seeded files (a bundled model's metadata values, value types and tensor dims
    mutated), judged in one process (tests/gguf_fuzz.py): the shared check, the daemon's
    start-up (its check, then the llama.cpp worker's load and the supervisor's vocabulary
    comparison), models check's reading (its check, then the vocabulary as its describe
    process reads it), the native loader. No party crashes, every refusal is one line; the
    daemon and models check serve or refuse each file alike; a refusal of the check is every
    party's, word for word; the native loader loads exactly the files models check says it
    runs; the process's peak RSS stays under twice the smallest file plus 256 MB. A few of
    each kind go through the real ``hetspec models check`` command too."""
    mutations = draw_mutations(FUZZ_SEED, FUZZ_FILES)
    specs, verdicts = tmp_path / "mutations.json", tmp_path / "verdicts.jsonl"
    specs.write_text(json.dumps(mutations))
    script = Path(__file__).with_name("gguf_fuzz.py")
    done = subprocess.run(
        [sys.executable, str(script), str(specs), str(verdicts)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [json.loads(line) for line in verdicts.read_text().splitlines()]
    records = [line for line in lines if "check" in line]
    if done.returncode != 0:
        last = max(line["index"] for line in lines if "started" in line)
        pytest.fail(
            f"the judging process died (status {done.returncode}) on file {last}, "
            f"{mutations[last]}: {done.stderr[-3000:]}"
        )
    assert len(records) == FUZZ_FILES
    failures = [
        f"{r['index']} {mutations[r['index']]}: {problem}"
        for r in records
        for problem in disagreements(r)
    ]
    assert not failures, "\n".join(failures[:20])
    smallest = min(r["size"] for r in records)
    assert lines[-1]["peak_rss"] < 2 * smallest + 256 * MiB, lines[-1]["peak_rss"] / MiB
    kinds = {(r["check"][0], r["daemon"][0]) for r in records}
    assert kinds == {("refused", "refused"), ("ok", "ok"), ("ok", "refused")}, kinds
    # the real command on a few of each kind: its exit status and line are those judged above
    by_kind: dict[tuple, list] = {}
    for record in records:
        by_kind.setdefault((record["check"][0], record["models_check"][0]), []).append(record)
    for record in [r for group in by_kind.values() for r in group[:2]]:
        spec = mutations[record["index"]]
        path = tmp_path / "files" / f"{record['index']}.gguf"  # where it was judged
        apply(RawGGUF.read(BASES[spec["base"]]), spec["mutations"]).write(path)
        command = models_check(path)
        assert "Traceback" not in command.stderr
        if record["models_check"][0] == "ok":
            assert command.returncode == 0, command.stdout + command.stderr
        elif record["check"][0] == "refused":  # one line: exit 1, or 2 for no GGUF read here
            assert command.returncode in (1, 2), command.stdout + command.stderr
            assert command.stderr.count("\n") == 1, command.stderr
            assert record["check"][1] in command.stderr
        else:  # its vocabulary: llama.cpp cannot read it, or it is not the draft's
            assert command.returncode == 1, command.stdout + command.stderr
            assert "vocabulary: NOT shared" in command.stdout


def disagreements(record: dict) -> list[str]:
    """What ``record`` (one file's verdicts, see tests/gguf_fuzz.py) shows wrong."""
    problems = []
    parties = ("check", "daemon", "models_check", "native", "llama_cpp")
    for party in parties:
        kind, line = record[party]
        if kind == "crash" or (line is not None and "\n" in line):
            problems.append(f"{party}: {kind} {line!r}")
    check, daemon, models = record["check"], record["daemon"], record["models_check"]
    if daemon[0] != models[0]:
        problems.append(f"the daemon {daemon} but models check {models}")
    if check[0] == "refused":
        for party in parties[1:]:
            if record[party][0] != "refused" or (
                party != "llama_cpp" and check[1] not in record[party][1]
            ):  # (llama.cpp refuses a header it cannot read in its own words)
                problems.append(f"the check refused ({check[1]}), {party} {record[party]}")
    else:  # models check read the file: its native line
        native_runs = record["models_check_native"] is None
        if native_runs != (record["native"][0] == "ok"):
            says = "run it" if native_runs else "do not"
            problems.append(f"models check says the native kernels {says}: {record['native']}")
    return problems


def test_the_checks_idea_of_the_native_kernels_is_theirs() -> None:
    """The shared check covers the architectures the native kernels run; models check (which
    may not import them) keeps its own copy of the RoPE scalings they compute: the same."""
    from hetspec.daemon.load.model_check import NATIVE_ROPE_SCALINGS  # noqa: PLC0415
    from hetspec.native.model import FAMILIES, ROPE_SCALINGS  # noqa: PLC0415
    from hetspec.protocol.gguf_checks import CHECKED_ARCHITECTURES  # noqa: PLC0415
    from hetspec.protocol.gguf_checks import ROPE_SCALINGS as LLAMA_CPP_SCALINGS  # noqa: PLC0415

    assert set(CHECKED_ARCHITECTURES) == set(FAMILIES)
    assert NATIVE_ROPE_SCALINGS == ROPE_SCALINGS
    assert set(ROPE_SCALINGS) <= set(LLAMA_CPP_SCALINGS)

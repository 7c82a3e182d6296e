"""llama.cpp's own llama-server as the bench's peer: finding/building it, its command line, its
timings, its failures; and, where the binary is already built, the real server.

Building llama-server takes about 9 minutes on 2 cores, so the suite never builds it: the tests
that need the real binary skip, with the reason, when native/build-llama-server.sh has not
been run on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from hetspec.bench import llama_server_peers
from hetspec.bench.llama_server import (
    BUILD_SCRIPT,
    LlamaServer,
    LlamaServerError,
    LlamaServerUnavailable,
    ServerConfig,
    cached_binary,
    completion_request,
    find_llama_server,
    server_args,
    timing_of,
)
from hetspec.bench.peers import DRAFT_GGUF as DRAFT  # the bundled pair, the peers' default
from hetspec.bench.peers import TARGET_GGUF as TARGET

PROMPT = 'def read_lines(path):\n    """Return the lines of a file."""\n'

# The timings of real /completion replies of this llama-server (0.3.36's llama.cpp, bundled
# target, with and without the bundled draft at --spec-draft-n-max 3, PROMPT, 64 tokens), as
# it sent them; a reply's other keys: content, generation_settings, has_new_line, id_slot,
# index, model, prompt, stop, stop_type, stopping_word, tokens, tokens_cached,
# tokens_evaluated, tokens_predicted, truncated.
SPECULATIVE_TIMINGS = {
    "cache_n": 0,
    "prompt_n": 18,
    "prompt_ms": 2.571,
    "prompt_per_token_ms": 0.14283333333333334,
    "prompt_per_second": 7001.166861143523,
    "predicted_n": 64,
    "predicted_ms": 34.898,
    "predicted_per_token_ms": 0.553936507936508,
    "predicted_per_second": 1805.261046478308,
    "draft_n": 69,
    "draft_n_accepted": 40,
}
ALONE_TIMINGS = {
    "cache_n": 0,
    "prompt_n": 18,
    "prompt_ms": 1.974,
    "prompt_per_token_ms": 0.10966666666666666,
    "prompt_per_second": 9118.54103343465,
    "predicted_n": 64,
    "predicted_ms": 24.662,
    "predicted_per_token_ms": 0.39146031746031745,
    "predicted_per_second": 2554.53734490309,
}


def executable(path: Path, text: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + text)
    path.chmod(0o755)
    return path


# ------------------------------------------------------------------ without the binary


def test_target_alone_command_line_uses_a_unix_socket_and_every_core() -> None:
    config = ServerConfig(TARGET, threads=3, context=1024)
    args = server_args(Path("/opt/llama-server"), config, Path("/tmp/x/llama-server.sock"))
    assert args[0] == "/opt/llama-server"
    pairs = dict(zip(args[1::2], args[2::2], strict=False))
    assert pairs["-m"] == str(TARGET)
    assert args[args.index("--host") + 1] == "/tmp/x/llama-server.sock"  # never a TCP port
    assert "--port" not in args
    for flag, value in (("-t", "3"), ("-tb", "3"), ("-c", "1024"), ("-np", "1")):
        assert args[args.index(flag) + 1] == value
    assert {"--no-webui", "--no-cache-prompt"} <= set(args)
    assert args[args.index("--cache-ram") + 1] == "0"
    assert not {"-md", "--spec-type", "-td", "--spec-draft-n-max", "-fa"} & set(args)


def test_speculative_command_line_names_the_draft_its_threads_and_length() -> None:
    default = server_args(Path("ls"), ServerConfig(TARGET, DRAFT, threads=2), Path("s.sock"))
    assert default[default.index("-md") + 1] == str(DRAFT)
    assert default[default.index("--spec-type") + 1] == "draft-simple"
    assert default[default.index("-td") + 1] == default[default.index("-tbd") + 1] == "2"
    assert "--spec-draft-n-max" not in default  # the server's own default length
    sized = server_args(Path("ls"), ServerConfig(TARGET, DRAFT, 6, threads=2), Path("s.sock"))
    assert sized[sized.index("--spec-draft-n-max") + 1] == "6"
    assert "--spec-draft-p-min" not in sized  # the server's own default
    sure = server_args(Path("ls"), ServerConfig(TARGET, DRAFT, 6, 0.75), Path("s.sock"))
    assert sure[sure.index("--spec-draft-p-min") + 1] == "0.75"
    off = server_args(Path("ls"), ServerConfig(TARGET, flash_attention="off"), Path("s.sock"))
    assert off[off.index("-fa") + 1] == "off"


def test_threads_default_to_the_cores_this_process_owns() -> None:
    assert ServerConfig(TARGET).threads == len(os.sched_getaffinity(0))


def test_request_is_greedy_exact_length_and_prefills_the_whole_prompt() -> None:
    body = completion_request("x = ", 64)
    assert body["n_predict"] == 64
    assert body["ignore_eos"] is True
    assert body["temperature"] == 0
    assert body["top_k"] == 1
    assert body["cache_prompt"] is False
    assert body["stream"] is False


def test_sampled_request_draws_from_the_softmax_at_its_temperature_alone() -> None:
    """llama-server's own defaults (top-k 40, top-p 0.95, min-p 0.05) are off, as in
    hetspec's requests, so both sample the same distribution; the seed goes with it."""
    body = completion_request("x = ", 64, temperature=0.8, seed=7)
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"]) == (0.8, 0, 1, 0)
    assert body["seed"] == 7
    assert body["n_predict"] == 64
    assert body["ignore_eos"] is True
    assert "seed" not in completion_request("x = ", 64, temperature=0.8)
    assert completion_request("x = ", 64, seed=7) == completion_request("x = ", 64)  # greedy


def test_timings_become_ttft_and_decode() -> None:
    """prompt_ms ends when the first token is sampled; predicted_ms covers the other tokens."""
    spec = timing_of({"content": "...", "timings": SPECULATIVE_TIMINGS, "tokens": [5, 7]})
    assert spec == (2.571, 34.898, 64, 69, 40, (5, 7))  # the ids, where the reply lists them
    assert spec.ttft_ms == 2.571
    assert spec.decode_ms == 34.898
    # the server's own rate counts the same tokens: (n - 1) / predicted_ms
    rate = (spec.tokens - 1) / spec.decode_ms * 1000
    assert rate == pytest.approx(SPECULATIVE_TIMINGS["predicted_per_second"])
    alone = timing_of({"timings": ALONE_TIMINGS})
    assert (alone.draft_n, alone.draft_n_accepted) == (0, 0)  # absent without a draft
    assert (alone.tokens - 1) / alone.decode_ms * 1000 == pytest.approx(
        ALONE_TIMINGS["predicted_per_second"]
    )


def test_missing_binary_is_one_clear_error_without_a_build(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HETSPEC_CACHE_DIR", str(tmp_path))
    with pytest.raises(LlamaServerUnavailable, match="not built") as caught:
        find_llama_server(build=False)
    assert "\n" not in str(caught.value)
    assert str(tmp_path) in str(caught.value)
    assert "build-llama-server.sh" in str(caught.value)


def test_cached_binary_is_found_without_running_the_script(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HETSPEC_CACHE_DIR", str(tmp_path))
    binary = cached_binary()
    assert binary.is_relative_to(tmp_path / "llama-server")
    binary.parent.mkdir(parents=True)
    executable(binary, "exit 0\n")
    assert find_llama_server(build=True, script=tmp_path / "absent.sh") == binary


@pytest.mark.process
def test_failed_build_says_the_scripts_last_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HETSPEC_CACHE_DIR", str(tmp_path))
    said = "build-llama-server: cmake is not installed"
    script = executable(
        tmp_path / "build.sh",
        f'echo "Compiling."\necho "warning: noise" >&2\necho "{said}" >&2\nexit 1\n',
    )
    progress = tmp_path / "progress.txt"
    with progress.open("w") as sink, pytest.raises(LlamaServerUnavailable) as caught:
        find_llama_server(build=True, script=script, progress=sink)
    assert str(caught.value) == f"building llama-server failed: {said}"
    assert progress.read_text() == "Compiling.\n"


@pytest.mark.process
def test_successful_build_returns_the_path_it_printed_last(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HETSPEC_CACHE_DIR", str(tmp_path))
    made = tmp_path / "made" / "llama-server"
    script = executable(
        tmp_path / "build.sh",
        f'mkdir -p "{made.parent}"\n'
        f'printf "#!/bin/sh\\n" > "{made}"; chmod +x "{made}"\n'
        f'echo "Compiling."\necho "{made}"\n',
    )
    with (tmp_path / "progress.txt").open("w") as sink:
        assert find_llama_server(build=True, script=script, progress=sink) == made
    missing = executable(tmp_path / "liar.sh", f'echo "{tmp_path / "nothing"}"\n')
    with (tmp_path / "progress.txt").open("w") as sink, pytest.raises(LlamaServerUnavailable):
        find_llama_server(build=True, script=missing, progress=sink)


@pytest.mark.process
def test_build_script_fails_in_one_line_without_cmake(tmp_path) -> None:
    """The real script, on a PATH with only what it needs before looking for cmake."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "dirname", "sed"):
        (tools / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(tools), "HOME": str(tmp_path), "HETSPEC_CACHE_DIR": str(tmp_path / "c")}
    done = subprocess.run(
        [str(tools / "bash"), str(BUILD_SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "build-llama-server: cmake is not installed (apt install cmake)"
    ]
    unknown = subprocess.run(
        [str(tools / "bash"), str(BUILD_SCRIPT), "rocm"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert unknown.returncode == 2
    assert len(unknown.stderr.strip().splitlines()) == 1


@pytest.mark.process
def test_server_that_dies_at_start_says_why_and_leaves_nothing(tmp_path) -> None:
    said = "error: invalid argument: -tbd"
    fake = executable(tmp_path / "llama-server", f'echo "loading..."; echo "{said}" >&2; exit 1\n')
    folders = set(Path(tempfile.gettempdir()).glob("hetspec-llama-server-*"))
    with pytest.raises(LlamaServerError) as caught:
        LlamaServer(fake, ServerConfig(TARGET), start_timeout=30)
    assert str(caught.value) == (
        "llama-server exited with status 1 before it was ready: error: invalid argument: -tbd"
    )
    assert set(Path(tempfile.gettempdir()).glob("hetspec-llama-server-*")) == folders


@pytest.mark.process
def test_binary_that_cannot_run_is_one_clear_error(tmp_path) -> None:
    plain = tmp_path / "llama-server"
    plain.write_text("not a program")
    with pytest.raises(LlamaServerError, match=r"^cannot run .*llama-server: Permission denied$"):
        LlamaServer(plain, ServerConfig(TARGET))


class FakeServer:
    started: list[int] = []  # noqa: RUF012 - a test's log, reset per test

    def __init__(self, binary: Path, config: ServerConfig) -> None:
        self.config, self.closed = config, False
        self.process = subprocess.Popen(["sleep", "60"])
        FakeServer.started.append(config.n_max)

    def close(self) -> None:
        self.closed = True
        self.process.kill()
        self.process.wait()


@pytest.mark.process
def test_server_pool_keeps_the_most_recently_used(monkeypatch) -> None:
    monkeypatch.setattr(llama_server_peers, "LlamaServer", FakeServer)
    FakeServer.started = []
    pool = llama_server_peers.ServerPool(Path("llama-server"), limit=2)
    one, two, three = (ServerConfig(TARGET, DRAFT, n, threads=1) for n in (1, 2, 3))
    first = pool.get(one)
    assert pool.get(two) is not first
    assert pool.get(one) is first
    third = pool.get(three)  # two was used least recently: it stops
    assert FakeServer.started == [1, 2, 3]
    assert not first.closed
    assert pool.get(two) is not third
    assert FakeServer.started == [1, 2, 3, 2]
    assert first.closed
    second = pool.get(two)
    second.process.kill()
    second.process.wait()
    assert pool.get(two) is not second  # a server that died is started anew
    assert second.closed
    assert FakeServer.started == [1, 2, 3, 2, 2]
    pool.close()
    assert third.closed


@pytest.mark.process
@pytest.mark.slow
def test_peers_go_on_without_llama_server_and_say_why(tmp_path) -> None:
    """The peers' process with an unusable llama-server: the other peers, and the reason."""
    command = [
        sys.executable,
        "-m",
        "hetspec.bench.peers",
        "--threads",
        "1",
        "--llama-server",
        str(tmp_path / "absent"),
    ]
    request = json.dumps({"system": "transformers assisted", "prompt": PROMPT, "max_tokens": 4})
    done = subprocess.run(
        command, input=request + "\n", capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr
    first, answer = (json.loads(line) for line in done.stdout.splitlines())
    assert first["systems"] == [
        "llama-cpp-python loop speculative gamma=4",
        "transformers assisted",
    ]
    assert first["skipped"] == {"llama-server": f"{tmp_path / 'absent'} is not an executable file"}
    assert answer["tokens"] == 4
    assert answer["decode_ms"] > 0


@pytest.mark.process
@pytest.mark.slow
def test_sampled_peers_skip_the_greedy_loop_and_draw_the_others(tmp_path) -> None:
    """At a temperature the greedy-only loop is skipped with its reason, and transformers'
    assisted generation samples (seeded per request)."""
    command = [
        sys.executable,
        "-m",
        "hetspec.bench.peers",
        "--threads",
        "1",
        "--llama-server",
        "off",
        "--temperature",
        "0.8",
    ]
    requests = [
        {"system": "transformers assisted", "prompt": PROMPT, "max_tokens": 4, "seed": seed}
        for seed in (1, None)
    ]
    done = subprocess.run(
        command,
        input="".join(json.dumps(r) + "\n" for r in requests),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    first, *answers = (json.loads(line) for line in done.stdout.splitlines())
    assert first["systems"] == ["transformers assisted"]
    assert first["skipped"]["llama-cpp-python loop speculative gamma=4"] == (
        "greedy only (it verifies by the target's argmax)"
    )
    assert [a["tokens"] for a in answers] == [4, 4]
    refused = subprocess.run(
        [*command[:-1], "nan"], capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode == 2
    assert "--temperature must be a finite number >= 0, not nan" in refused.stderr


# ------------------------------------------------------------------ with the real binary


@pytest.fixture(scope="module")
def binary() -> Path:
    try:
        return find_llama_server(build=False)
    except LlamaServerUnavailable as error:
        pytest.skip(f"{error} (the suite never builds it: about 9 minutes)")


def greedy_tokens(prompt: str, count: int) -> list[int]:
    """The project's own greedy decoding of the target, token by token."""
    from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415

    runtime = LlamaCppRuntime(TARGET, n_ctx=2048, threads=1)
    try:
        runtime.prefill(runtime.tokenize(prompt))
        tokens = [int(np.argmax(runtime.last_logits()))]
        while len(tokens) < count:
            runtime.append(tokens[-1:])
            tokens.append(int(np.argmax(runtime.last_logits())))
        return tokens
    finally:
        runtime.close()


@pytest.mark.process
def test_target_alone_decodes_as_hetspecs_runtime_does(binary: Path) -> None:
    """Same model file, greedy: llama-server's tokens are the project's runtime's, so its speed
    is compared on the same work."""
    expected = greedy_tokens(PROMPT, 32)
    with LlamaServer(binary, ServerConfig(TARGET, threads=1)) as server:
        reply = server.generate(PROMPT, 32)
        assert reply["tokens"] == expected, reply["content"]
        again = server.complete(PROMPT, 32)
        assert again.tokens == 32
        assert again.ttft_ms > 0
        assert again.decode_ms > 0
        assert server.generate(PROMPT, 32)["timings"]["cache_n"] == 0  # nothing reused


@pytest.mark.process
def test_speculative_server_is_lossless_and_stops_cleanly(binary: Path) -> None:
    with LlamaServer(binary, ServerConfig(TARGET, DRAFT, 3, threads=1)) as server:
        reply = server.generate(PROMPT, 32)
        timing = server.complete(PROMPT, 32)
        process, folder = server.process, server.folder
    assert reply["tokens"] == greedy_tokens(PROMPT, 32)
    assert timing.tokens == 32
    assert 0 < timing.draft_n_accepted <= timing.draft_n
    assert process.poll() is not None
    assert not folder.exists()


@pytest.mark.process
def test_sampled_server_follows_its_seed(binary: Path) -> None:
    """At a temperature the server draws: the same seed the same tokens, another seed
    others, and neither is the greedy text."""
    with LlamaServer(binary, ServerConfig(TARGET, DRAFT, 3, threads=1)) as server:
        first = server.generate(PROMPT, 32, temperature=1.0, seed=1)["tokens"]
        again = server.generate(PROMPT, 32, temperature=1.0, seed=1)["tokens"]
        other = server.generate(PROMPT, 32, temperature=1.0, seed=2)["tokens"]
        timing = server.complete(PROMPT, 32, temperature=1.0, seed=3)
    assert first == again
    assert other != first
    assert first != greedy_tokens(PROMPT, 32)
    assert timing.tokens == 32


@pytest.mark.process
@pytest.mark.slow
def test_peers_process_serves_llama_servers_systems(binary: Path) -> None:
    """The peers' process with the real server: alone, default and best-of-sweep systems."""
    command = [sys.executable, "-m", "hetspec.bench.peers", "--llama-server", str(binary)]
    request = {"system": "llama-server target alone", "prompt": PROMPT, "max_tokens": 16}
    done = subprocess.run(
        command,
        input=json.dumps(request) + "\n",
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    first, answer = (json.loads(line) for line in done.stdout.splitlines())
    assert first["skipped"] == {}
    best = first["llama_server"]["best_n_max"]
    assert set(first["llama_server"]["sweep"]) == {"1", "2", "3", "4", "6", "8"}
    flash = first["llama_server"]["flash_attention"]  # the faster one, with both speeds
    assert flash["chosen"] == max(("on", "off"), key=flash.__getitem__)
    assert min(flash["on"], flash["off"]) > 0
    p_min = first["llama_server"]["sweep_p_min"]  # 0 and the old default 0.75, the faster
    assert set(p_min) == {"0.0", "0.75"}
    chosen = max(p_min, key=p_min.__getitem__)
    assert first["systems"][2:] == [
        "llama-server target alone",
        "llama-server speculative (default n-max)",
        f"llama-server speculative n-max={best} p-min={chosen}",
    ]
    assert answer["tokens"] == 16
    assert answer["draft_n"] == 0
    assert answer["decode_ms"] > 0

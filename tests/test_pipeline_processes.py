"""FlowSpec's pipeline across processes: `hetspec-stage` processes on the loopback interface,
each holding a range of the bundled target's layers, reached over ZeroMQ TCP with CURVE, driven
by the daemon's coordinator (daemon/pipeline/coordinator.py)."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.daemon.pipeline.coordinator import PipelineError, pipeline_decode
from hetspec.daemon.pipeline.local_stages import LocalStages
from hetspec.protocol.curve_keys import CurveKeyError, load_secret, make_keys
from hetspec.speculative.flow.flow_tree import FlowTree
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.workers.runtimes.torch_runtime import TorchRuntime

pytestmark = pytest.mark.process

TARGET = BUNDLED_MODELS / "target"
PROMPT = "def read_lines(path):\n    with open(path) as"
# half-layers (speculative/flow/layer_split.py): three stages split layers 1 and 2 after attention
SPLITS = {2: [(0, 4), (4, 8)], 3: [(0, 3), (3, 5), (5, 8)]}
TOKENS = 32


def start_stages(folder: Path, splits) -> LocalStages:
    stages = LocalStages(folder, TARGET, splits)
    stages.wait(timeout_s=60)
    return stages


def run_then_stop(stages: LocalStages, scenario) -> None:
    try:
        asyncio.run(scenario())
    finally:
        stages.stop()


@pytest.fixture(scope="module")
def greedy() -> list[int]:
    runtime = TorchRuntime(TARGET, device="cpu", dtype="float32", max_context=512)
    runtime.prefill(runtime.tokenize(PROMPT))
    tokens = runtime.draft(TOKENS + 8, SamplingParams(), DrawnSampler(0)).tokens[0].tolist()
    return runtime.tokenize(PROMPT), tokens


def oracle_drafter(greedy_tokens, accuracy: float, seed: int):
    """Drafts below the two best leaves: the target's own next token (where the leaf is on
    the target's path) with probability ``accuracy``, else a wrong one, and a wrong sibling."""
    rng = random.Random(seed)
    prompt, continuation = greedy_tokens

    def draft(tree: FlowTree, final: list[int]) -> None:
        if tree.unsent() >= 4:
            return
        for leaf in sorted(
            (i for i, n in tree.nodes.items() if not n.children), key=lambda i: -tree.nodes[i].score
        )[:2]:
            depth = tree.nodes[leaf].position + 1 - len(prompt)
            right = continuation[depth] if depth < len(continuation) else 0
            guess = right if rng.random() < accuracy else (right + 7) % 4096
            score = min(tree.nodes[leaf].score, 1.0) * 0.8
            tree.add(leaf, guess, score)
            tree.add(leaf, (guess + 1) % 4096, score * 0.1)

    return draft


@pytest.mark.parametrize("stages", [2, 3])
def test_stage_processes_verify_to_the_targets_greedy_text(tmp_path, greedy, stages) -> None:
    pipeline = start_stages(tmp_path, SPLITS[stages])

    async def scenario() -> None:
        client = pipeline.client()
        try:
            for seed, accuracy in ((0, 0.8), (1, 0.3)):
                drafter = oracle_drafter(greedy, accuracy, seed)
                tokens, stats = await pipeline_decode(client, greedy[0], TOKENS, drafter)
                assert tokens == greedy[1][:TOKENS]
                assert stats.commits > 0
                assert stats.nodes_back <= stats.nodes_sent
        finally:
            client.close()

    run_then_stop(pipeline, scenario)


def test_a_client_without_an_admitted_key_gets_nothing(tmp_path) -> None:
    pipeline = start_stages(tmp_path, SPLITS[2])
    make_keys(pipeline.keys, ["stranger"])

    async def scenario() -> None:
        stranger = pipeline.client("stranger", timeout_s=1.0)
        try:
            with pytest.raises(PipelineError, match=r"stage\(s\) 0, 1 did not answer"):
                await stranger.reset()
        finally:
            stranger.close()
        client = pipeline.client()  # the stages are still fine for the right key
        try:
            assert len(await client.reset()) == 2
        finally:
            client.close()

    run_then_stop(pipeline, scenario)


def test_a_killed_stage_fails_the_request_within_two_seconds(tmp_path, greedy) -> None:
    pipeline = start_stages(tmp_path, SPLITS[3])

    async def scenario() -> None:
        client = pipeline.client(timeout_s=1.5)
        try:
            await client.reset()
            pipeline.kill(1)
            start = time.monotonic()
            with pytest.raises(PipelineError):
                await pipeline_decode(client, greedy[0], TOKENS, oracle_drafter(greedy, 0.8, 0))
            assert time.monotonic() - start < 2.0
            restart = time.monotonic()
            pipeline.start(1)  # what its supervisor (systemd, hetspecd) does
            pipeline.wait(1)
            await client.reset()
            assert time.monotonic() - restart < 5.0  # serving again within 5 s
            drafter = oracle_drafter(greedy, 0.8, 0)
            tokens, _ = await pipeline_decode(client, greedy[0], TOKENS, drafter)
            assert tokens == greedy[1][:TOKENS]
        finally:
            client.close()

    run_then_stop(pipeline, scenario)


def test_keys_are_private_and_never_overwritten(tmp_path) -> None:
    made = make_keys(tmp_path / "keys", ["a"])
    secret = next(p for p in made if p.name.endswith("key_secret"))
    assert secret.stat().st_mode & 0o777 == 0o600
    with pytest.raises(CurveKeyError, match="exists"):
        make_keys(tmp_path / "keys", ["a"])
    os.chmod(secret, 0o644)
    with pytest.raises(CurveKeyError, match="chmod 600"):
        load_secret(secret)
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetspec.workers.stage",
            "serve",
            "--model",
            str(TARGET),
            "--layers",
            "0:2",
            "--bind",
            "tcp://127.0.0.1:1",
            "--key",
            str(secret),
            "--authorized",
            str(tmp_path / "keys"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"hetspec-stage: {secret} may be read by others (mode 0644); chmod 600 it"
    ]


@pytest.mark.parametrize("stages", [2, 3])
def test_sampled_tokens_through_the_pipeline_follow_the_targets_law(tmp_path, stages) -> None:
    """Temperature 1, top-k 6: the second and third tokens' marginal laws through 2 and 3
    stage processes (3: split after attention) match the target's exact law (chi-square),
    keyed by seed and drawn."""
    from laws import chi2_critical, chi_square, exact_marginals  # noqa: PLC0415

    from hetspec.speculative.verify.distributions import SamplingParams as Params  # noqa: PLC0415
    from hetspec.speculative.verify.samplers import sampler_for  # noqa: PLC0415

    seeds = range(1200, 2400)  # keyed: one fixed sample, which fits (test_lossless's, once)
    prompt = "def add(a, b):\n"
    params = Params(temperature=1.0, top_k=6)
    runtime = TorchRuntime(TARGET, device="cpu", dtype="float32", max_context=512)
    law = exact_marginals(runtime, prompt, params)
    tokens = runtime.tokenize(prompt)
    pipeline = start_stages(tmp_path, SPLITS[stages])

    def likely_drafter(tree: FlowTree, final: list[int]) -> None:
        """The target's own two likeliest tokens below each leaf: drafts that do get
        accepted, now and then, when sampling."""
        if tree.unsent() > 1:  # more than the root waits to be sent
            return
        for leaf in [i for i, n in tree.nodes.items() if not n.children]:
            runtime.prefill(tokens + final[:-1] + tree.path_to(leaf))
            for rank, token in enumerate(np.argsort(runtime.last_logits())[::-1][:2]):
                tree.add(leaf, int(token), 0.5 / (rank + 1))

    async def sample(seeds) -> tuple[list[dict[int, int]], int]:
        counts: list[dict[int, int]] = [{}, {}, {}]
        client = pipeline.client()
        accepted = 0
        try:
            for seed in seeds:
                out, stats = await pipeline_decode(
                    client,
                    tokens,
                    3,
                    likely_drafter,
                    params=params,
                    sampler=sampler_for(seed),
                    segment_size=3,
                )
                accepted += stats.drafted_final
                for position, token in enumerate(out):
                    counts[position][token] = counts[position].get(token, 0) + 1
        finally:
            client.close()
        return counts, accepted

    try:
        keyed, keyed_accepted = asyncio.run(sample(seeds))
        drawn, drawn_accepted = asyncio.run(sample([None] * len(seeds)))
    finally:
        pipeline.stop()
    assert keyed_accepted > len(seeds) // 4  # drafts were taken, not just the target's own
    assert drawn_accepted > len(seeds) // 4
    for counts, p in ((keyed, 0.001), (drawn, 0.0001)):
        for position in (1, 2):
            statistic, df = chi_square(counts[position], law[position], len(seeds))
            assert df >= 1
            assert statistic < chi2_critical(df, p), (position, statistic, df)


def test_a_draft_workers_tree_and_its_expansion_verify_to_the_greedy_text(tmp_path, greedy):
    """The bundled draft model in a llama.cpp worker drafts below each root and, with the
    tree kept small, expands the likeliest leaves while the root waits: chains whose scores
    never rise, hung below leaves; 3 stage processes still return the target's greedy text."""
    from hetspec.daemon.pipeline.drafter import PipelineDrafter, TreeShape  # noqa: PLC0415
    from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerSpec  # noqa: PLC0415
    from hetspec.protocol import Arena  # noqa: PLC0415
    from hetspec.protocol import worker_messages as m  # noqa: PLC0415

    pipeline = start_stages(tmp_path, SPLITS[3])
    draft = BUNDLED_MODELS / "draft" / "draft-q8_0.gguf"
    chains: list[list[float]] = []

    async def scenario() -> None:
        with Arena.create(
            f"/dev/shm/hetspec-test-{os.getpid()}", slots=1, slot_bytes=1 << 20
        ) as arena:
            spec = WorkerSpec(
                "cpu", "llama.cpp", str(draft), m.LlamaCppSettings(n_ctx=512), log_format="console"
            )
            worker = WorkerClient(spec, tmp_path, 1, arena.layout)
            await worker.start(load_timeout_s=120)
            client = pipeline.client()
            try:
                shape = TreeShape(depth=2, top_k=2, size=3, expand_steps=2)
                drafter = PipelineDrafter(worker, arena, shape)

                async def watched(tree: FlowTree) -> bool:
                    before = set(tree.nodes)
                    grew = await drafter.expand(tree)
                    added = [i for i in tree.nodes if i not in before]
                    assert grew == bool(added)
                    if added:
                        parent = tree.nodes[added[0]].parent
                        assert parent in before
                        assert list(tree.nodes[parent].children.values()) == [added[0]]
                        chains.append(
                            [tree.nodes[parent].score, *(tree.nodes[i].score for i in added)]
                        )
                    return grew

                await drafter.start(greedy[0])
                tokens, stats = await pipeline_decode(
                    client, greedy[0], TOKENS, drafter, segment_size=2, expand=watched
                )
                assert tokens == greedy[1][:TOKENS]
                assert stats.drafted_final > TOKENS // 4  # the draft model is good enough
            finally:
                client.close()
                await worker.stop()

    run_then_stop(pipeline, scenario)
    assert chains
    assert all(later <= earlier for chain in chains for earlier, later in itertools.pairwise(chain))

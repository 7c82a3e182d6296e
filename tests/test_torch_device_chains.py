"""Chains whose forwards run back to back on the device (greedy decoding alone, drafting):
the same tokens and bits as the host's one-forward-a-step loops, here in the CPU's fixed
shapes (the CUDA graphs' shapes; tests/test_cuda_graphs.py runs them on a GPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import build_reference, save_reference

from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler, KeyedSampler
from hetspec.workers.runtimes.torch_runtime import TorchRuntime, device_choice, static_forward
from hetspec.workers.runtimes.tree_runtime import TreeRuntime

PROMPT = [1, 17, 42, 5, 88, 23, 9, 61, 2, 70, 33, 14]


@pytest.fixture(autouse=True)
def small_spans(monkeypatch):  # span buckets 16, 32 ..: 30 tokens cross two of them
    monkeypatch.setattr(static_forward, "MIN_SPAN", 16)
    monkeypatch.setattr(static_forward, "TAIL_BLOCK", 4)  # split attention's points 4 apart


def runtime_for(
    tmp_path, name: str, fixed_width: int = 4, attention: str = "gathered"
) -> TorchRuntime:
    folder = tmp_path / name
    if not folder.exists():
        save_reference(build_reference(name), folder)
    return TorchRuntime(
        folder, device="cpu", dtype="float32", fixed_width=fixed_width, attention=attention
    )


def decoded(runtime: TorchRuntime, decode, steps: int, host_forwards: int = 0):
    """(tokens, logprobs, the logits after, features) of one decode call after the prompt,
    which makes ``host_forwards`` forwards of the host's loop."""
    runtime.rollback(0)
    runtime.prefill(PROMPT)
    logprobs: list = []
    extend = runtime._extend_committed
    calls = []
    runtime._extend_committed = lambda tokens: calls.append(tokens) or extend(tokens)
    try:
        with runtime.features_captured() as features:
            tokens = decode(
                runtime, steps, SamplingParams(), DrawnSampler(0), logprobs=logprobs, top=3
            )
    finally:
        del runtime._extend_committed
    assert len(calls) == host_forwards
    return tokens, logprobs, runtime.last_logits().copy(), np.concatenate(features)


@pytest.mark.parametrize("attention", ["gathered", "split"])
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "gemma2"])
def test_greedy_decoding_on_the_device_gives_the_host_loops_bits(tmp_path, name, attention) -> None:
    runtime = runtime_for(tmp_path, name, attention=attention)
    steps = 30
    watched = runtime._split if attention == "split" else runtime._in_place
    in_place, run = [], watched.run
    watched.run = lambda *a: in_place.append(1) or run(*a)
    chained = decoded(runtime, TorchRuntime.decode, steps)
    assert len(in_place) >= steps - 1  # the prefill's and each token's forwards attend in place
    assert runtime.deep_rows == 0  # a chain in the cache's order is never too deep
    assert runtime.tokens[len(PROMPT) :] == chained[0][:-1]  # the last is drawn, not evaluated
    host = decoded(runtime, TreeRuntime.decode, steps, host_forwards=steps - 1)
    assert chained[0] == host[0]
    assert len(set(chained[0])) > 3  # a real continuation, not one token over and over
    assert chained[1] == host[1]  # log-probabilities and alternatives, exactly
    assert np.array_equal(chained[2], host[2])
    assert chained[3].shape == (steps - 1, runtime.feature_size)
    assert np.array_equal(chained[3], host[3])
    # its cache holds what the host's loop would: the next call goes on alike
    decoded(runtime, TorchRuntime.decode, steps)
    runtime.append(chained[0][-1:])
    more = runtime.decode(5, SamplingParams(), DrawnSampler(0))
    runtime.rollback(0)
    runtime.prefill([*PROMPT, *chained[0]])
    assert more == TreeRuntime.decode(runtime, 5, SamplingParams(), DrawnSampler(0))


def sampled(runtime: TorchRuntime, decode, steps: int, sampler, temperature: float = 0.8):
    """(tokens, logprobs, the logits after, features) of one sampled decode after the prompt."""
    runtime.rollback(0)
    runtime.prefill(PROMPT)
    logprobs: list = []
    with runtime.features_captured() as features:
        tokens = decode(
            runtime,
            steps,
            SamplingParams(temperature=temperature),
            sampler,
            logprobs=logprobs,
            top=2,
        )
    return tokens, logprobs, runtime.last_logits().copy(), np.concatenate(features)


@pytest.mark.parametrize(
    ("sampler", "margin"),
    [
        (lambda: KeyedSampler(11), device_choice.MARGIN),
        (lambda: KeyedSampler(11), 0.3),
        (lambda: KeyedSampler(11), 1e9),
        (lambda: DrawnSampler(5), device_choice.MARGIN),
    ],
    ids=["keyed", "keyed-some-left-to-the-host", "keyed-all-left-to-the-host", "drawn"],
)
def test_sampled_decoding_on_the_device_gives_the_host_loops_tokens(
    tmp_path, monkeypatch, sampler, margin
) -> None:
    """Each choice on the device, guarded: wherever the host might have chosen otherwise it
    chooses, so the tokens, log-probabilities, features and the logits after are the host
    loop's. (A drawn sampler's uniforms come from the same generator in the same order, so
    while no choice is left to the host its tokens are the host loop's too.)"""
    monkeypatch.setattr(device_choice, "MARGIN", margin)
    runtime = runtime_for(tmp_path, "gemma3")
    steps = 30
    calls = []
    queued = runtime.decode
    runtime.decode = lambda *a, **k: calls.append(a[0]) or queued(*a, **k)
    try:
        ours = sampled(runtime, TorchRuntime.decode, steps, sampler())
        restarts = len(calls)  # decode calls after the first: choices left to the host
        calls.clear()
        host = sampled(runtime, TreeRuntime.decode, steps, sampler())
    finally:
        del runtime.decode
    assert len(ours[0]) == steps
    assert ours[0] == host[0]
    assert len(set(ours[0])) > 3
    assert ours[1] == host[1]
    assert np.array_equal(ours[2], host[2])
    assert np.array_equal(ours[3], host[3])
    if margin == 1e9:
        assert restarts == steps - 1  # every choice the host's: a call for each token left
    elif margin == 0.3:
        assert 0 < restarts < steps - 1
    else:
        assert restarts == 0


def test_decoding_past_the_context_is_refused_before_any_forward(tmp_path) -> None:
    runtime = runtime_for(tmp_path, "qwen3")
    runtime.prefill(PROMPT * 20)  # 240 of the tiny model's 256 positions
    with pytest.raises(ValueError, match="context full"):
        runtime.decode(40, SamplingParams(), DrawnSampler(0))
    assert len(runtime.tokens) == 240


@pytest.mark.parametrize(
    ("params", "sampler"),
    [
        (SamplingParams(), lambda: DrawnSampler(0)),
        (SamplingParams(temperature=0.8), lambda: KeyedSampler(11)),
        (SamplingParams(temperature=0.8), lambda: DrawnSampler(5)),
    ],
    ids=["greedy", "keyed", "drawn"],
)
@pytest.mark.parametrize("attention", ["gathered", "split"])
def test_a_chained_draft_is_the_step_by_step_draft(tmp_path, params, sampler, attention) -> None:
    chained = runtime_for(tmp_path, "gemma3", attention=attention)
    stepwise = runtime_for(tmp_path, "gemma3", attention=attention)
    stepwise._run_chain = None  # TreeRuntime's loop: one forward and one choice a step
    results = []
    for runtime in (chained, stepwise):
        runtime.prefill(PROMPT)
        own = sampler()
        first = runtime.draft(8, params, own)
        first = (first.tokens.copy(), first.probs.copy())
        # a run-ahead draft from the last drafted token (drawn, not evaluated yet)
        ahead = runtime.draft(6, params, own, after=(6, int(first[0][0, -1])))
        results.append((first, (ahead.tokens.copy(), ahead.probs.copy()), runtime.pending))
    (first, ahead, pending), (first_host, ahead_host, pending_host) = results
    assert pending == pending_host == 7 + 1 + 5
    for ours, host in ((first, first_host), (ahead, ahead_host)):
        assert ours[0].tolist() == host[0].tolist()
        np.testing.assert_allclose(ours[1], host[1], rtol=0, atol=2e-6)
    # the drafted nodes are the same pending tree: the same logits after a shared path
    assert np.array_equal(
        chained.forward_tree([3], [12], extend=True).logits.numpy(),
        stepwise.forward_tree([3], [12], extend=True).logits.numpy(),
    )


def test_bench_verify_times_decoding_both_ways(tmp_path) -> None:
    from hetspec.bench import torch_verify as bench_verify  # noqa: PLC0415

    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    out = tmp_path / "verify.json"
    arguments = [
        "--model",
        str(folder),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--fixed-width",
        "4",
        "--contexts",
        "20",
        "--widths",
        "1,4",
        "--repeats",
        "2",
        "--decode",
        "9",
        "--json",
        str(out),
    ]
    assert bench_verify.main(arguments) == 0
    decode = json.loads(out.read_text())["decode"]
    assert decode["steps"] == 9
    assert decode["queued_ms_a_token"] > 0
    assert decode["host_loop_ms_a_token"] > 0
    assert decode["sampled_queued_ms_a_token"] > 0
    assert decode["sampled_host_loop_ms_a_token"] > 0

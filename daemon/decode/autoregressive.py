"""The target alone (autoregressive mode): the baseline every speculative mode is measured
against, and how many tokens one call decodes when the target decodes alone."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import numpy as np

from hetspec.daemon.decode.core_lending import CoreLending
from hetspec.daemon.decode.prompt_input import (
    prefill,
    prompt_ids,
    record_prompt,
    wanted_prompt_logprobs,
)
from hetspec.daemon.decode.requests import (
    GenerateRequest,
    GenerationResult,
    end_ids,
    token_budget,
)
from hetspec.daemon.decode.text_output import TextOutput
from hetspec.daemon.supervision.worker_client import WorkerClient
from hetspec.protocol import Arena
from hetspec.protocol import worker_messages as m
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.control.core_choice import SpareCoreChoice
from hetspec.speculative.verify.distributions import distribution
from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.speculative.verify.samplers import Sampler, sampler_for

# When the target decodes alone (autoregressive mode, rounds without a draft) a call decodes
# as many tokens as take about ALONE_CALL_S of its compute: each call has a fixed cost besides
# (messages, the daemon streaming the tokens), and every 16th call measures the other core
# choice (see spare_cores), so few tokens per call cost a slow target dearly
# (docs/design-notes.md, "Tokens per call"). 50 ms of tokens arriving at once still read as a
# stream (20 pieces a second), a stop string or a client that hangs up wastes at most that.
ALONE_CALL_S = 0.05
MAX_ALONE_TOKENS = 128
TRIAL_TOKENS = 2  # a call that measures the other core choice (see SpareCoreChoice.exploring)


def alone_tokens(token_s: float | None, *, trial: bool = False) -> int:
    """Tokens per call for a target taking ``token_s`` per token (None: not known yet); at
    most TRIAL_TOKENS for a ``trial`` of the core choice not preferred."""
    if not token_s or token_s <= 0:
        return 2
    most = TRIAL_TOKENS if trial else MAX_ALONE_TOKENS
    return max(1, min(most, int(ALONE_CALL_S / token_s)))


def first_token(logits: np.ndarray, params: SamplingParams, sampler: Sampler, position: int) -> int:
    """The token after the prompt (at ``position``, the prompt's length), from the prefill's
    (1, vocab) logits (every mode's)."""
    if params.greedy:
        return int(np.argmax(logits[0]))
    return int(sampler.choose(distribution(logits, params), position)[0])


async def generate(
    request: GenerateRequest,
    worker: WorkerClient,
    slot: int,
    result: GenerationResult,
    *,
    arena: Arena,
    cores: SpareCoreChoice | CoreLending,
    sequence: int = 0,
    prefill_chunk: int = 0,
) -> AsyncIterator[str]:
    """Yield text pieces; ``result`` holds the tokens and timings (complete when exhausted).
    The first token is chosen here from the prefill's logits (in arena slot ``slot``), as the
    speculative modes choose theirs: no call of its own. Then several tokens per call
    (``alone_tokens``, ``Decode``): the worker evaluates the last call's last token and draws
    the next ones, one forward each, committing them as it goes. The drafter has nothing to
    do in this mode: the target computes on its cores too, where ``cores`` finds that this
    pays. ``sequence``: the request's in the worker; ``prefill_chunk``: see ``prefill``."""
    ready = worker.ready
    started = time.perf_counter()
    prompt = await prompt_ids(request, worker, ready.context)
    max_tokens = token_budget(request, len(prompt), ready.context)
    prefilled, _ = await prefill(
        worker,
        m.Prefill(
            request=worker.next_request(),
            tokens=prompt,
            seed=request.seed,
            out=slot,
            spare_cores=cores.preferred(),
            prompt_logprobs=wanted_prompt_logprobs(request),
            sequence=sequence,
        ),
        prefill_chunk,
    )
    record_prompt(result, prompt, prefilled)
    # the worker's keyed choices continue the daemon's (seeded); unseeded draws are independent
    sampler = sampler_for(request.seed)
    logits = arena.view(prefilled.logits)
    tokens = [first_token(logits, request.sampling, sampler, len(prompt))]
    top = request.logprobs  # None: no log-probabilities
    logprobs = [token_logprob(logits[0], tokens[0], top)] if top is not None else None
    if max_tokens == 0:  # the prompt's prefill alone (an echo)
        tokens = []
    result.prompt_tokens = len(prompt)
    result.prompt_ms = (time.perf_counter() - started) * 1000
    decode_start = time.perf_counter()
    output = TextOutput(ready.token_bytes, request.stops, ready.special_tokens)
    ends = end_ids(request, ready.vocab)
    token_s = cores.cost_s()  # the worker's seconds per token, from the last call
    try:
        while True:
            pieces = []  # one write per call, not per token
            for index, token in enumerate(tokens):
                if token in ends:
                    if logprobs and index < len(logprobs):  # the end token's: reported
                        result.logprobs.append(logprobs[index])
                    result.done_reason = "stop"
                    break
                result.add(token, logprobs[index] if logprobs else None)
                pieces.append(output.add(token))
                if output.stopped:
                    result.done_reason = "stop"
                    break
            if any(pieces):
                yield "".join(pieces)
            if len(result.tokens) >= max_tokens or result.done_reason == "stop":
                break
            spare_cores = cores.choose()
            steps = alone_tokens(token_s, trial=cores.exploring)
            decoded, _ = await worker.call(
                m.Decode(
                    request=worker.next_request(),
                    steps=min(steps, max_tokens - len(result.tokens)),
                    sampling=request.sampling,
                    append=tokens[-1:],  # the last call's last token: drawn, not evaluated
                    spare_cores=spare_cores,
                    logprobs=top,
                    ends=sorted(ends),
                    sequence=sequence,
                )
            )
            tokens, logprobs = decoded.tokens, decoded.logprobs
            token_s = decoded.elapsed_ms / 1000 / len(tokens)
            cores.record(spare_cores, token_s)
        tail = output.flush()
        if tail:
            yield tail
    finally:
        result.decode_ms = (time.perf_counter() - decode_start) * 1000

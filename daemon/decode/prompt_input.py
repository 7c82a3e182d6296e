"""A request's prompt as the target reads it: its token ids, and what its prefill reports."""

from __future__ import annotations

import msgspec

from hetspec.daemon.decode.requests import GenerateRequest, GenerationResult
from hetspec.daemon.supervision.worker_client import WorkerClient
from hetspec.protocol import worker_messages as m


async def prompt_ids(request: GenerateRequest, worker: WorkerClient, context: int) -> list[int]:
    """The prompt's token ids: the request's own (checked against the target's vocabulary and
    the ``context``), else the target's tokenization of its text. Bad input: ValueError,
    naming the field."""
    if request.prompt_tokens is None:
        worker.prompt_bound.check(request.prompt, context)
        tokenized, _ = await worker.call(
            m.Tokenize(request=worker.next_request(), text=request.prompt)
        )
        return tokenized.tokens
    size = worker.ready.vocab.size
    outside = next((t for t in request.prompt_tokens if not 0 <= t < size), None)
    if outside is not None:
        raise ValueError(f"prompt: token id {outside} is outside the vocabulary (0..{size - 1})")
    if len(request.prompt_tokens) > context:
        raise ValueError(
            f"prompt: {len(request.prompt_tokens)} tokens exceed the {context}-token context"
        )
    return list(request.prompt_tokens)


def wanted_prompt_logprobs(request: GenerateRequest) -> int | None:
    """``Prefill.prompt_logprobs`` for this request: the alternatives per prompt token, or
    None where its prompt's log-probabilities were not asked for."""
    return request.logprobs if request.prompt_logprobs else None


def record_prompt(result: GenerationResult, prompt: list[int], prefilled: m.Prefilled) -> None:
    """What the answer reports of its prompt: the ids, and the prefill's log-probabilities."""
    result.prompt_ids = prompt
    result.prompt_logprobs = list(prefilled.prompt_logprobs)


async def prefill(worker: WorkerClient, command: m.Prefill, chunk: int = 0, arrays=()):
    """``worker.call(command, arrays)``, the prompt in calls of ``chunk`` tokens where it is longer
    (0: one call): each call makes a longer prefix of it the committed sequence, reusing the
    last, so that requests decoding beside it have their commands run between the calls
    instead of waiting for the whole prompt. A prefill that reads every position (the
    prompt's log-probabilities, a head's features) is one call. The last call's reply."""
    tokens = command.tokens
    whole = (
        command.prompt_logprobs is not None
        or command.report_features
        or command.features is not None
    )
    if chunk <= 0 or len(tokens) <= chunk or whole:
        return await worker.call(command, arrays)
    for end in range(chunk, len(tokens), chunk):
        part = msgspec.structs.replace(
            command, request=worker.next_request(), tokens=tokens[:end], out=-1
        )
        await worker.call(part)
    return await worker.call(command)

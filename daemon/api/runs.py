"""A generation in progress, as the HTTP layers see it: text pieces, then its statistics.

Both APIs (native NDJSON and OpenAI SSE) stream a ``Run`` the same way: the first piece is
awaited before the response starts, so a request that fails early (a prompt too long for the
context, a worker that is down) still gets a proper 4xx/5xx; a failure after that ends the
stream with an error object instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from hetspec.daemon.api.errors import ApiError
from hetspec.daemon.decode.requests import GenerationResult
from hetspec.daemon.decode.round_stats import SpeculativeStats
from hetspec.daemon.pipeline.coordinator import PipelineError
from hetspec.daemon.supervision.supervisor import WorkerUnavailable
from hetspec.daemon.supervision.worker_client import WorkerError
from hetspec.protocol import TokenLogprob
from hetspec.speculative.control.budget import BudgetController

log = structlog.get_logger("hetspec.daemon.api.runs")


@dataclass
class Run:
    id: str
    mode: str
    pieces: AsyncIterator[str]
    result: GenerationResult
    devices: dict[str, str | None]
    queue_ms: float
    stats: SpeculativeStats | None = None  # None in autoregressive mode
    controller: BudgetController | None = None
    token_bytes: list[bytes] = field(default_factory=list)  # what each id stands for
    _logprobs_sent: int = 0

    def unsent_logprobs(self) -> list[dict]:
        """The log-probabilities of the tokens generated since the last call (a streamed
        piece carries its tokens'; the last object what is left), in OpenAI chat's form, which
        Ollama's follows: each token's text (invalid UTF-8 as U+FFFD), its bytes, its
        log-probability and the alternatives likewise."""
        entries = self.result.logprobs[self._logprobs_sent :]
        self._logprobs_sent += len(entries)
        return self._logprob_entries(entries)

    def prompt_logprobs(self) -> list[dict]:
        """The prompt's tokens after the first with their log-probabilities (an echo's), in
        ``unsent_logprobs``' form; empty where the request did not ask."""
        return self._logprob_entries(self.result.prompt_logprobs)

    def _logprob_entries(self, entries: list[TokenLogprob]) -> list[dict]:

        def token(token_id: int, logprob: float) -> dict:
            raw = self.token_bytes[token_id]
            return {"token": raw.decode(errors="replace"), "logprob": logprob, "bytes": list(raw)}

        return [
            {
                **token(entry.token, entry.logprob),
                "top_logprobs": [token(i, logprob) for i, logprob in entry.top],
            }
            for entry in entries
        ]

    def speculative(self) -> dict | None:
        return self.stats.summary(self.controller) if self.stats is not None else None

    def timings(self) -> dict:
        """llama.cpp server's ``timings`` (its names), plus our time to first token."""
        result = self.result
        decode_s = result.decode_ms / 1000
        return {
            "prompt_n": result.prompt_tokens,
            "prompt_ms": round(result.prompt_ms, 3),
            "predicted_n": len(result.tokens),
            "predicted_ms": round(result.decode_ms, 3),
            "predicted_per_second": round(len(result.tokens) / decode_s, 2) if decode_s else 0,
            "ttft_ms": round(result.ttft_ms, 3) if result.ttft_ms is not None else None,
            "queue_ms": round(self.queue_ms, 3),
        }

    def statistics(self) -> dict:
        """What every API reports beside its own fields: the tokens, llama.cpp-style timings,
        the mode, the devices and, for a speculative mode, our statistics."""
        timings = self.timings()
        document = {
            "tokens": self.result.tokens,
            "timings": timings,
            "mode": self.mode,
            "devices": self.devices,
        }
        speculative = self.speculative()
        if speculative is not None:
            timings["draft_n"] = speculative.pop("draft_n")
            timings["draft_n_accepted"] = speculative.pop("draft_n_accepted")
            document["speculative"] = speculative
        return document


def as_api_error(error: Exception) -> ApiError:
    """The client-facing form of a failure during generation; a bug of ours is re-raised."""
    if isinstance(error, (WorkerError, WorkerUnavailable, PipelineError)):
        return ApiError(503, f"generation failed: {error}", retry_after_s=2)
    if isinstance(error, ValueError):  # the prompt does not fit the context, ...
        return ApiError(400, str(error))
    raise error


async def collect(run: Run) -> str:
    """The whole text of a run that is not streamed."""
    try:
        return "".join([piece async for piece in run.pieces])
    except Exception as error:
        raise as_api_error(error) from None


async def stream(
    request: web.Request,
    run: Run,
    *,
    content_type: str,
    encode_piece: Callable[[str], bytes],
    encode_end: Callable[[], bytes],
    encode_failure: Callable[[ApiError], bytes],
) -> web.StreamResponse:
    """Stream a run's pieces as they are verified; the first is awaited before responding."""

    @contextlib.asynccontextmanager
    async def opened():
        yield run

    return await stream_runs(
        request,
        [opened()],
        content_type=content_type,
        encode_piece=lambda _, piece: encode_piece(piece),
        encode_run_end=lambda _: b"",
        encode_end=lambda _: encode_end(),
        encode_failure=encode_failure,
    )


def _quiet_when_the_client_leaves(streaming):
    """A client that resets mid-stream unwinds its runs as cancelled and leaves the handler
    as aiohttp's premature disconnection (a debug line), not an unhandled error."""

    @functools.wraps(streaming)
    async def streamed(request: web.Request, *args, **kwargs) -> web.StreamResponse:
        try:
            return await streaming(request, *args, **kwargs)
        except ConnectionResetError:
            log.debug("client left mid-stream", path=request.path)
            raise asyncio.CancelledError from None

    return streamed


@_quiet_when_the_client_leaves
async def stream_runs(
    request: web.Request,
    runs: list[AbstractAsyncContextManager[Run]],
    *,
    content_type: str,
    encode_piece: Callable[[int, str], bytes],
    encode_run_end: Callable[[Run], bytes],
    encode_end: Callable[[list[Run]], bytes],
    encode_failure: Callable[[ApiError], bytes],
) -> web.StreamResponse:
    """Stream several runs one after another in one response (each opened only when the one
    before it is done: its turn in the queue comes then); ``encode_piece`` gets the run's
    index. The first run's first piece is awaited before responding, so an early failure is
    a proper 4xx/5xx; a later failure ends the stream with an error object."""
    response: web.StreamResponse | None = None
    finished: list[Run] = []
    try:
        for index, opening in enumerate(runs):
            async with opening as run:
                try:
                    first = await anext(run.pieces, "")
                except Exception as error:
                    failure = as_api_error(error)
                    if response is None:
                        raise failure from None
                    run.result.done_reason = "error"
                    raise _Failed(failure) from None
                if response is None:
                    response = web.StreamResponse(
                        headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
                    )
                    await response.prepare(request)
                try:
                    if first:
                        await response.write(encode_piece(index, first))
                    async for piece in run.pieces:
                        await response.write(encode_piece(index, piece))
                except ConnectionResetError:  # the client left: not an error to answer
                    raise
                except Exception as error:
                    failure = as_api_error(error)  # after the response began: an error object
                    run.result.done_reason = "error"
                    raise _Failed(failure) from None
                await response.write(encode_run_end(run))
                finished.append(run)
    except _Failed as failed:
        await response.write(encode_failure(failed.error))
    except ApiError as error:  # a later run refused (the queue full, the daemon draining)
        if response is None:
            raise  # nothing sent yet: the client gets this status
        await response.write(encode_failure(error))
    else:
        await response.write(encode_end(finished))
    await response.write_eof()
    return response


class _Failed(Exception):
    """A run failed after the response began: the stream ends with this error."""

    def __init__(self, error: ApiError) -> None:
        self.error = error

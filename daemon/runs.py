"""A generation in progress, as the HTTP layers see it: text pieces, then its statistics.

Both APIs (native NDJSON and OpenAI SSE) stream a ``Run`` the same way: the first piece is
awaited before the response starts, so a request that fails early (a prompt too long for the
context, a worker that is down) still gets a proper 4xx/5xx; a failure after that ends the
stream with an error object instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from hetspec.daemon.api_errors import ApiError
from hetspec.daemon.requests import GenerationResult
from hetspec.daemon.round_stats import SpeculativeStats
from hetspec.daemon.supervisor import WorkerUnavailable
from hetspec.daemon.worker_client import WorkerError
from hetspec.speculative.budget import BudgetController


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

    def final(self) -> dict:
        """The native API's last object: why it stopped, the tokens and all statistics."""
        timings = self.timings()
        document = {
            "done": True,
            "done_reason": self.result.done_reason,
            "id": self.id,
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
    if isinstance(error, (WorkerError, WorkerUnavailable)):
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
    try:
        first = await anext(run.pieces, "")
    except Exception as error:
        raise as_api_error(error) from None
    response = web.StreamResponse(
        headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        if first:
            await response.write(encode_piece(first))
        async for piece in run.pieces:
            await response.write(encode_piece(piece))
    except Exception as error:
        failure = as_api_error(error)  # after the response began: an error object ends it
        run.result.done_reason = "error"
        await response.write(encode_failure(failure))
    else:
        await response.write(encode_end())
    await response.write_eof()
    return response

"""OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``
(and ``/v1/models/{id}``).

Existing tools send OpenAI's parameters, so every one of them is accepted at its neutral value
and refused, with a message that says so, at any value hetspec cannot honour (``n`` > 1,
penalties, logprobs); a parameter OpenAI does not have is refused too. hetspec's own knobs
(``top_k``, ``mode``, ``gamma``) are extensions, and responses carry llama.cpp-style
``timings`` and our ``speculative`` statistics beside OpenAI's fields.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from hetspec.daemon.api_errors import ApiError, decode
from hetspec.daemon.chat_template import ChatMessage, ChatTemplateError
from hetspec.daemon.requests import GenerateRequest
from hetspec.daemon.runs import Run, collect, stream

if TYPE_CHECKING:
    from hetspec.daemon.service import Service


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None  # any name is served by the one loaded model
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default: sampling
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # hetspec's extensions
    top_k: int = 0
    mode: str | None = None
    gamma: int | None = None

    def _unsupported(self) -> list[str]:
        problems = []
        if self.n != 1:
            problems.append("n must be 1 (one answer per request)")
        if self.presence_penalty or self.frequency_penalty:
            problems.append(
                "presence_penalty and frequency_penalty are not supported "
                "(they would change the target's distribution); use 0"
            )
        if self.logit_bias:
            problems.append("logit_bias is not supported")
        return problems

    def generate_request(self, prompt: str, max_tokens: int | None, stops: list[str]):
        problems = self._unsupported()
        if problems:
            raise ApiError(400, "; ".join(problems))
        user_stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return GenerateRequest(
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                seed=self.seed,
                stop=user_stops + stops,
                stream=self.stream,
                mode=self.mode,
                gamma=self.gamma,
            )
        except ValueError as error:
            raise ApiError(400, f"invalid request: {error}") from None


class CompletionRequest(_Common, forbid_unknown_fields=True, kw_only=True):
    prompt: str | list[str]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt must be a string or a list of exactly one string")
        if self.echo or self.logprobs is not None or self.suffix or self.best_of != 1:
            raise ValueError("echo, logprobs, suffix and best_of are not supported")


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


class ChatRequest(_Common, forbid_unknown_fields=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # accepted at their neutral values: plain text, nothing stored
    response_format: ResponseFormat | None = None
    store: bool = False

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("messages must hold at least one message")
        if self.logprobs or self.top_logprobs is not None:
            raise ValueError("logprobs are not supported")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(f"response_format {self.response_format.type!r} is not supported: "
                             f"only {{'type': 'text'}}")  # fmt: skip
        if self.store:
            raise ValueError("store is not supported: hetspec keeps no completions")


def _event(document: dict | str) -> bytes:
    data = document if isinstance(document, str) else msgspec.json.encode(document).decode()
    return f"data: {data}\n\n".encode()


def openai_routes(service: Service) -> list[web.RouteDef]:
    def envelope(run: Run, kind: str) -> dict:
        return {
            "id": run.id,
            "object": kind,
            "created": int(time.time()),
            "model": service.model_name,
        }

    def usage(run: Run) -> dict:
        prompt, completion = run.result.prompt_tokens, len(run.result.tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def extras(run: Run) -> dict:
        final = run.final()  # llama.cpp-style timings and our statistics, beside OpenAI's
        keys = ("timings", "speculative", "mode", "tokens", "devices")
        return {key: final[key] for key in keys if key in final}

    async def respond(request, body, generate: GenerateRequest, chat: bool):
        kind = "chat.completion" if chat else "text_completion"
        async with service.generation(generate) as run:
            if not body.stream:
                text = await collect(run)
                reason = run.result.done_reason
                choice = (
                    {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
                )
                return web.json_response(
                    {
                        **envelope(run, kind),
                        "choices": [
                            {"index": 0, **choice, "logprobs": None, "finish_reason": reason}
                        ],
                        "usage": usage(run),
                        **extras(run),
                    }
                )

            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            first = [True]

            def chunk(text: str | None, reason: str | None = None) -> dict:
                if chat:
                    delta = {} if text is None else {"content": text}
                    if first[0]:
                        delta, first[0] = {"role": "assistant", **delta}, False
                    choice = {"delta": delta}
                else:
                    choice = {"text": text or ""}
                return {
                    **envelope(run, chunk_kind),
                    "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": reason}],
                }

            def end() -> bytes:
                events = _event(chunk(None, run.result.done_reason))
                if body.stream_options and body.stream_options.include_usage:
                    events += _event(
                        {
                            **envelope(run, chunk_kind),
                            "choices": [],
                            "usage": usage(run),
                            **extras(run),
                        }
                    )
                return events + _event("[DONE]")

            def failure(error: ApiError) -> bytes:
                return _event(error.body()) + _event("[DONE]")

            return await stream(
                request,
                run,
                content_type="text/event-stream",
                encode_piece=lambda piece: _event(chunk(piece)),
                encode_end=end,
                encode_failure=failure,
            )

    async def completions(request: web.Request) -> web.StreamResponse:
        body = decode(await request.read(), CompletionRequest)
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        return await respond(
            request, body, body.generate_request(prompt, body.max_tokens, []), chat=False
        )

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = decode(await request.read(), ChatRequest)
        template = service.chat_template
        if template is None:
            raise ApiError(400, "the target model has no chat template; use /v1/completions")
        try:
            prompt = template.render(body.messages)
        except ChatTemplateError as error:
            raise ApiError(400, str(error)) from None
        limit = body.max_completion_tokens or body.max_tokens  # None: up to the context
        generate = body.generate_request(prompt, limit, template.stops)
        return await respond(request, body, generate, chat=True)

    def model_card() -> dict:
        created = int(service.started_wall)
        return {"id": service.model_name, "object": "model", "created": created,
                "owned_by": "hetspec"}  # fmt: skip

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card()]})

    async def model(request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != service.model_name:
            raise ApiError(404, f"no model {name!r}: this daemon serves {service.model_name!r}")
        return web.json_response(model_card())

    return [
        web.post("/v1/completions", completions),
        web.post("/v1/chat/completions", chat_completions),
        web.get("/v1/models", models),
        web.get("/v1/models/{model}", model),
    ]

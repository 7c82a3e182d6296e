"""OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``
(and ``/v1/models/{id}``).

Existing tools send OpenAI's parameters, so every one of them is accepted at its neutral value
and refused, with a message that says so, at any value hetspec cannot honour (penalties,
``echo``); a parameter OpenAI does not have is refused too. Log-probabilities are the target's
(``logprobs`` on completions, ``logprobs``/``top_logprobs`` on chat). Several answers (``n``,
a list of prompts) are generated one after another, each a turn in the queue. hetspec's own knobs
(``top_k``, ``mode``, ``gamma``) are extensions, and responses carry llama.cpp-style
``timings`` and our ``speculative`` statistics beside OpenAI's fields.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from hetspec.daemon.api.chat_template import ChatMessage, ChatTemplateError
from hetspec.daemon.api.errors import ApiError, decode
from hetspec.daemon.api.runs import Run, collect, stream_runs
from hetspec.daemon.decode.requests import GenerateRequest

if TYPE_CHECKING:
    from hetspec.daemon.service import Service


MAX_CHOICES = 16  # answers in one request (n x prompts); they run one after another


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

    def wanted_logprobs(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: none."""
        return None

    def shaped_logprobs(self, entries: list[dict], offset: int) -> dict | None:
        """A choice's ``logprobs`` for these tokens (``Run.unsent_logprobs``); ``offset``:
        where their text begins in the answer."""
        return None

    def _unsupported(self) -> list[str]:
        problems = []
        if self.presence_penalty or self.frequency_penalty:
            problems.append(
                "presence_penalty and frequency_penalty are not supported "
                "(they would change the target's distribution); use 0"
            )
        if self.logit_bias:
            problems.append("logit_bias is not supported")
        return problems

    def generate_requests(
        self, prompts: list[str], max_tokens: int | None, stops: list[str]
    ) -> list[GenerateRequest]:
        """One generation per answer: ``n`` for each prompt, in the order of the response's
        choices; with a seed, the j-th answer to a prompt is drawn with seed + j (the same
        seed would draw the same text n times)."""
        problems = self._unsupported()
        answers = len(prompts) * self.n
        if self.n < 1 or answers > MAX_CHOICES:
            problems.append(
                f"n x prompts must be 1 to {MAX_CHOICES} answers, not {answers} "
                f"(they are generated one after another)"
            )
        if problems:
            raise ApiError(400, "; ".join(problems))
        user_stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return [
                GenerateRequest(
                    prompt=prompt,
                    max_tokens=max_tokens,
                    temperature=self.temperature,
                    top_k=self.top_k,
                    top_p=self.top_p,
                    seed=None if self.seed is None else self.seed + answer,
                    stop=user_stops + stops,
                    stream=self.stream,
                    mode=self.mode,
                    gamma=self.gamma,
                    logprobs=self.wanted_logprobs(),
                )
                for prompt in prompts
                for answer in range(self.n)
            ]
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
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must be a string or a list of strings, not an empty list")
        if self.echo or self.suffix or self.best_of != 1:
            raise ValueError("echo, suffix and best_of are not supported")

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def shaped_logprobs(self, entries: list[dict], offset: int) -> dict | None:
        """The completions API's older form: parallel lists, alternatives as dicts."""
        if self.logprobs is None:
            return None
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry["token"])
        return {
            "tokens": [entry["token"] for entry in entries],
            "token_logprobs": [entry["logprob"] for entry in entries],
            "top_logprobs": [
                {top["token"]: top["logprob"] for top in entry["top_logprobs"]} for entry in entries
            ]
            if self.logprobs
            else None,
            "text_offset": offsets,
        }


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
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(
                f"response_format {self.response_format.type!r} is not supported: "
                f"only {{'type': 'text'}}"
            )
        if self.store:
            raise ValueError("store is not supported: hetspec keeps no completions")

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def shaped_logprobs(self, entries: list[dict], offset: int) -> dict | None:
        return {"content": entries, "refusal": None} if self.logprobs else None


def _event(document: dict | str) -> bytes:
    data = document if isinstance(document, str) else msgspec.json.encode(document).decode()
    return f"data: {data}\n\n".encode()


def _envelope(run: Run, kind: str, model: str) -> dict:
    return {"id": run.id, "object": kind, "created": int(time.time()), "model": model}


def _usage(runs: list[Run], n: int) -> dict:
    """Every answer's tokens; each prompt's once (its n answers share it)."""
    prompt = sum(run.result.prompt_tokens for run in runs[::n])
    completion = sum(len(run.result.tokens) for run in runs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class _StreamedAnswers:
    """SSE chunks of answers streamed one after another, each under its choice index."""

    def __init__(self, service: Service, body: _Common, chat: bool) -> None:
        self.service, self.body, self.chat = service, body, chat
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.opened: list[Run] = []  # the response's id is the first one's
        self.started: set[int] = set()  # the choices whose first chunk went out
        self.offsets: dict[int, int] = {}  # per choice: where its next token's text begins

    @contextlib.asynccontextmanager
    async def answer(self, generate: GenerateRequest):
        async with self.service.generation(generate) as run:
            self.opened.append(run)
            yield run

    def chunk(self, index: int, text: str | None, reason: str | None = None) -> bytes:
        """One choice's piece of text (None: none), and why it ended where it did."""
        if self.chat:
            delta = {} if text is None else {"content": text}
            if index not in self.started:  # a choice's first chunk names the role
                delta = {"role": "assistant", **delta}
            choice = {"delta": delta}
        else:
            choice = {"text": text or ""}
        self.started.add(index)
        logprobs = None
        if self.body.wanted_logprobs() is not None:  # the tokens generated since the last chunk
            entries = self.opened[index].unsent_logprobs()
            logprobs = self.body.shaped_logprobs(entries, self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + sum(len(e["token"]) for e in entries)
        choices = [{"index": index, **choice, "logprobs": logprobs, "finish_reason": reason}]
        model = self.service.model_name
        return _event({**_envelope(self.opened[0], self.kind, model), "choices": choices})

    def run_end(self, run: Run) -> bytes:
        # answers run one after another: the one ending is the last opened
        return self.chunk(len(self.opened) - 1, None, run.result.done_reason)

    def end(self, runs: list[Run]) -> bytes:
        options = self.body.stream_options
        if not (options and options.include_usage):
            return _event("[DONE]")
        document = {
            **_envelope(runs[0], self.kind, self.service.model_name),
            "choices": [],
            "usage": _usage(runs, self.body.n),
        }
        if len(runs) > 1:  # the extras, per answer in the choices' order
            document["answers"] = [run.statistics() for run in runs]
        else:
            document.update(runs[0].statistics())
        return _event(document) + _event("[DONE]")

    @staticmethod
    def failure(error: ApiError) -> bytes:
        return _event(error.body()) + _event("[DONE]")


def openai_routes(service: Service) -> list[web.RouteDef]:
    async def respond(request, body, generates: list[GenerateRequest], chat: bool):
        if not body.stream:
            kind = "chat.completion" if chat else "text_completion"
            runs, choices = [], []
            for index, generate in enumerate(generates):
                async with service.generation(generate) as run:
                    text = await collect(run)
                runs.append(run)
                content = (
                    {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
                )
                logprobs = body.shaped_logprobs(run.unsent_logprobs(), 0)
                choices.append(
                    {
                        "index": index,
                        **content,
                        "logprobs": logprobs,
                        "finish_reason": run.result.done_reason,
                    }
                )
            document = {
                **_envelope(runs[0], kind, service.model_name),
                "choices": choices,
                "usage": _usage(runs, body.n),
            }
            if len(runs) == 1:
                document.update(runs[0].statistics())
            else:
                for choice, run in zip(choices, runs, strict=True):
                    choice.update(run.statistics())
            return web.json_response(document)
        answers = _StreamedAnswers(service, body, chat)
        return await stream_runs(
            request,
            [answers.answer(generate) for generate in generates],
            content_type="text/event-stream",
            encode_piece=answers.chunk,
            encode_run_end=answers.run_end,
            encode_end=answers.end,
            encode_failure=answers.failure,
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        body = decode(await request.read(), CompletionRequest)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        generates = body.generate_requests(prompts, body.max_tokens, [])
        return await respond(request, body, generates, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = decode(await request.read(), ChatRequest)
        template = service.chat_template
        if template is None:
            raise ApiError(400, "the target model has no chat template; use /v1/completions")
        service.check_chat_size(len(body.messages))
        try:
            prompt = template.render(body.messages)
        except ChatTemplateError as error:
            raise ApiError(400, str(error)) from None
        limit = body.max_completion_tokens or body.max_tokens  # None: up to the context
        generates = body.generate_requests([prompt], limit, template.stops)
        return await respond(request, body, generates, chat=True)

    def model_card() -> dict:
        created = int(service.started_wall)
        return {
            "id": service.model_name,
            "object": "model",
            "created": created,
            "owned_by": "hetspec",
        }

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

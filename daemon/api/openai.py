"""OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``
(and ``/v1/models/{id}``).

Existing tools send OpenAI's parameters, so every one of them is accepted at its neutral value
and refused, with a message that says so, at any value hetspec cannot honour (penalties,
``suffix``); those that change nothing here (``user``, ``metadata``, ...) are ignored; a
parameter OpenAI does not have is refused, naming it. Log-probabilities are the target's
(``logprobs`` on completions, with ``echo`` the prompt's too; ``logprobs``/``top_logprobs`` on
chat). Chat takes ``tools`` and ``tool_choice``: an answer may be a call, its
arguments kept valid by the tool's schema (tool_calls.py). Several answers (``n``,
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
from hetspec.daemon.api.structured import ResponseFormat, openai_grammar
from hetspec.daemon.api.tokens import token_routes
from hetspec.daemon.api.tool_calls import (
    NamedToolChoice,
    ReplyReader,
    Tool,
    ToolUse,
    chat_prompt,
    check_tools,
    tool_use,
    whole_reply,
)
from hetspec.daemon.decode.requests import GenerateRequest
from hetspec.protocol.sampling import MAX_TOP_LOGPROBS
from hetspec.speculative.constrain.grammars import Grammar

if TYPE_CHECKING:
    from hetspec.daemon.service import Service


MAX_CHOICES = 16  # answers in one request (n x prompts); they run one after another


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    # accepted and ignored: per-chunk usage (vLLM's), padding against length attacks (OpenAI's)
    continuous_usage_stats: bool = False
    include_obfuscation: bool = True


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
    # accepted and ignored: they change nothing hetspec generates
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # an answer makes one call at most either way
    # hetspec's extensions
    top_k: int = 0
    mode: str | None = None
    gamma: int | None = None
    grammar: Grammar | None = None  # a regex, Lark or GBNF grammar (see structured.py)

    def wanted_logprobs(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: none."""
        return None

    def wanted_grammar(self) -> Grammar | None:
        """The grammar the output must keep (ValueError where the fields conflict)."""
        return self.grammar

    def shaped_logprobs(self, entries: list[dict], offset: int) -> dict | None:
        """A choice's ``logprobs`` for these tokens (``Run.unsent_logprobs``); ``offset``:
        where their text begins in the answer."""
        return None

    def wants_prompt_logprobs(self) -> bool:
        return False

    def choice_logprobs(self, run: Run, echoed: str) -> dict | None:
        """A whole (not streamed) choice's ``logprobs``; ``echoed``: the prompt's text
        where the choice begins with it."""
        return self.shaped_logprobs(run.unsent_logprobs(), 0)

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
        self, prompts: list[str | list[int]], max_tokens: int | None, stops: list[str]
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
                    prompt=prompt if isinstance(prompt, str) else "",
                    prompt_tokens=None if isinstance(prompt, str) else prompt,
                    prompt_logprobs=self.wants_prompt_logprobs(),
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
                    grammar=self.wanted_grammar(),
                )
                for prompt in prompts
                for answer in range(self.n)
            ]
        except ValueError as error:
            raise ApiError(400, f"invalid request: {error}") from None


class CompletionRequest(_Common, forbid_unknown_fields=True, kw_only=True):
    # a text, a list of texts, token ids (one prompt), or a list of token-id lists
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False  # the answer begins with the prompt (with logprobs: its tokens' too)
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int = 1

    def __post_init__(self) -> None:
        self.prompts()  # validates the prompt's shape
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be 0..{MAX_TOP_LOGPROBS}, not {self.logprobs}")
        if self.echo and self.stream:
            raise ValueError("echo is not streamed: send stream: false with echo")
        if self.suffix or self.best_of != 1:
            raise ValueError("suffix and best_of are not supported")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids (ValueError: neither)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [prompt]
        if prompt and all(isinstance(p, str) for p in prompt):
            return prompt
        if prompt and all(isinstance(p, list) and p for p in prompt):
            return prompt
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "non-empty token-id lists"
        )

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def wants_prompt_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None

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

    def choice_logprobs(self, run: Run, echoed: str) -> dict | None:
        """With echo, the prompt's tokens first: the first with no log-probability (nothing
        precedes it: ``null``, its alternatives ``null``), each later one the target's given
        the tokens before it; then the answer's. Offsets count in the tokens' texts joined
        (the choice's text, but for a control token such as a BOS the prompt began with)."""
        if not self.wants_prompt_logprobs():
            return super().choice_logprobs(run, echoed)
        ids = run.result.prompt_ids
        first = run.token_bytes[ids[0]].decode(errors="replace")
        entries = run.prompt_logprobs()
        prompt = self.shaped_logprobs(entries, len(first))
        end = len(first) + sum(len(entry["token"]) for entry in entries)
        answer = self.shaped_logprobs(run.unsent_logprobs(), end)
        return {
            "tokens": [first, *prompt["tokens"], *answer["tokens"]],
            "token_logprobs": [None, *prompt["token_logprobs"], *answer["token_logprobs"]],
            "top_logprobs": [None, *prompt["top_logprobs"], *answer["top_logprobs"]]
            if self.logprobs
            else None,
            "text_offset": [0, *prompt["text_offset"], *answer["text_offset"]],
        }

    def echoed(self, run: Run, generate: GenerateRequest) -> str:
        """The text an answer begins with: its prompt as sent (token ids: their text), or
        nothing without echo."""
        if not self.echo:
            return ""
        if generate.prompt_tokens is None:
            return generate.prompt
        return b"".join(run.token_bytes[t] for t in generate.prompt_tokens).decode(errors="replace")


class ChatRequest(_Common, forbid_unknown_fields=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None  # structured output
    tools: list[Tool] | None = None  # see tool_calls.py
    tool_choice: str | NamedToolChoice | None = None
    # accepted at its neutral value: nothing stored
    store: bool = False

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("messages must hold at least one message")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        check_tools(self.tools)
        self.wanted_grammar()  # response_format, grammar, tools: a 400 now where they conflict
        if 0 in (self.max_tokens, self.max_completion_tokens):  # only an echo makes no tokens
            raise ValueError("max_tokens and max_completion_tokens must be at least 1")
        if self.store:
            raise ValueError("store is not supported: hetspec keeps no completions")

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_use(self) -> ToolUse | None:
        """What the tools ask (None: none offered); ValueError naming the field."""
        return tool_use(self.tools, self.tool_choice)

    def wanted_grammar(self) -> Grammar | None:
        grammar = openai_grammar(self.response_format, self.grammar)
        use = self.tool_use()
        if use is None or not use.may_call:
            return grammar
        if grammar is not None:
            raise ValueError(
                f"{grammar.field} cannot constrain an answer that may call a tool: send "
                'tool_choice "none" with it, or leave it out'
            )
        return use.grammar()

    def reply(self, text: str, done_reason: str) -> tuple[dict, str]:
        """A whole answer's ``message`` and ``finish_reason`` (a call: ``tool_calls``)."""
        use = self.tool_use()
        if use is None or not use.may_call:
            return {"role": "assistant", "content": text}, done_reason
        return whole_reply(text, done_reason, use.must_call)

    def reply_reader(self) -> ReplyReader | None:
        """What reads a streamed answer that may be a call (None: it is text)."""
        use = self.tool_use()
        return ReplyReader(use.must_call) if use is not None and use.may_call else None

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
        self.readers: dict[int, ReplyReader | None] = {}  # per chat choice: its call, if any

    @contextlib.asynccontextmanager
    async def answer(self, generate: GenerateRequest):
        async with self.service.generation(generate) as run:
            self.opened.append(run)
            yield run

    def reader(self, index: int) -> ReplyReader | None:
        if index not in self.readers:
            self.readers[index] = self.body.reply_reader() if self.chat else None
        return self.readers[index]

    def piece(self, index: int, text: str) -> bytes:
        """One choice's piece of text; one that may be a call goes as its reader says."""
        reader = self.reader(index)
        if reader is None:
            return self.chunk(index, text)
        delta = reader.feed(text)
        return b"" if delta is None else self.chunk(index, None, delta=delta)

    def chunk(
        self, index: int, text: str | None, reason: str | None = None, delta: dict | None = None
    ) -> bytes:
        """One choice's piece of text (None: none) or chat ``delta``, and why it ended where
        it did."""
        if self.chat:
            delta = delta or ({} if text is None else {"content": text})
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
        index = len(self.opened) - 1
        reader = self.reader(index)
        if reader is None:
            return self.chunk(index, None, run.result.done_reason)
        delta, reason = reader.finish(run.result.done_reason)
        return self.chunk(index, None, reason, delta=delta)

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
                echoed = "" if chat else body.echoed(run, generate)
                reason = run.result.done_reason
                if chat:
                    message, reason = body.reply(text, reason)
                    content = {"message": message}
                else:
                    content = {"text": echoed + text}
                logprobs = body.choice_logprobs(run, echoed)
                choices.append(
                    {
                        "index": index,
                        **content,
                        "logprobs": logprobs,
                        "finish_reason": reason,
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
            encode_piece=answers.piece,
            encode_run_end=answers.run_end,
            encode_end=answers.end,
            encode_failure=answers.failure,
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        body = decode(await request.read(), CompletionRequest)
        generates = body.generate_requests(body.prompts(), body.max_tokens, [])
        return await respond(request, body, generates, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = decode(await request.read(), ChatRequest)
        template = service.chat_template
        if template is None:
            raise ApiError(400, "the target model has no chat template; use /v1/completions")
        service.check_chat_size(len(body.messages))
        try:
            prompt = chat_prompt(template, body.messages, body.tool_use())
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
        *token_routes(service),
    ]

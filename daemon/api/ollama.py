"""Ollama's API, hetspec's native one: ``/api/generate``, ``/api/chat``, ``/api/tags``,
``/api/show``, ``/api/version``, ``/api/ps``.

Ollama's field names and units (durations in nanoseconds), so Ollama's clients work as they
are; hetspec's knobs (``mode``, ``gamma``, ``branches``, ``dynamic``, ``ignore_eos``) are
extensions at the top level, and the last object of a generation also carries our ``id``,
``tokens``, llama.cpp-style ``timings``, ``mode``, ``devices`` and ``speculative`` statistics.
Options hetspec cannot honour are refused with a 400 naming them, unless at their neutral
value; the load-time options (``num_ctx``, ``num_gpu``, ...) are the daemon's configuration,
which a request does not change: accepted, and a ``num_ctx`` above the served context served at
that context, the last object saying so (``served_context``). ``/api/chat`` takes ``tools``:
an answer may call one (tool_calls.py), the call in the last object's ``message.tool_calls``.
Errors are Ollama's ``{"error": "message"}``.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from hetspec import __version__
from hetspec.daemon.api.chat_template import (
    CalledFunction,
    ChatMessage,
    ChatTemplateError,
    MessageToolCall,
)
from hetspec.daemon.api.errors import ApiError, decode
from hetspec.daemon.api.runs import Run, collect, stream
from hetspec.daemon.api.structured import ollama_grammar
from hetspec.daemon.api.tool_calls import (
    ReplyReader,
    Tool,
    ToolUse,
    chat_prompt,
    check_tools,
    tool_use,
    whole_reply,
)
from hetspec.daemon.decode.requests import GenerateRequest
from hetspec.speculative.constrain.grammars import Grammar

if TYPE_CHECKING:
    from hetspec.daemon.load.model_facts import ModelFacts
    from hetspec.daemon.service import Service

DEFAULT_NUM_PREDICT = 128  # /api/generate's; /api/chat's runs to the turn's end
# a model kept loaded "forever" (keep_alive < 0) expires, in Ollama's /api/ps, at this date
NEVER = "2318-01-01T00:00:00Z"
_NEUTRAL = {
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "tfs_z": 1.0,
    "typical_p": 1.0,
    "min_p": 0.0,
    "mirostat": 0,
}
_ZERO_DURATION = re.compile(r"[+-]?0*\.?0*(ns|us|µs|ms|s|m|h)?")


class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Ollama's ``options``. Sampling: temperature (hetspec's default 0: greedy), top_k,
    top_p, seed, num_predict (-1 or -2: to the end of the context), stop."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: str | list[str] | None = None  # Ollama's is a list; some clients send one string
    # accepted at their neutral values only (_NEUTRAL)
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    min_p: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    # no effect without a penalty
    repeat_last_n: int | None = None
    penalize_newline: bool | None = None
    num_keep: int | None = None
    # how Ollama loads a model: the daemon's configuration here
    num_ctx: int | None = None
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None

    def problems(self, context: int | None) -> list[str]:
        found = []
        if self.num_predict is not None and not (
            self.num_predict in (-1, -2) or self.num_predict >= 1
        ):
            found.append(
                f"options.num_predict must be 1 or more, or -1 or -2 (to the end of "
                f"the context), not {self.num_predict}"
            )
        found += [
            f"options.{name} is not supported (it would change the target's "
            f"distribution); leave it out or use {neutral}"
            for name, neutral in _NEUTRAL.items()
            if getattr(self, name) not in (None, neutral)
        ]
        return found


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What /api/generate and /api/chat share: Ollama's fields, then hetspec's extensions."""

    model: str | None = None  # any name is served by the one loaded model
    stream: bool = True
    options: Options | None = None
    format: Any = None  # structured output: "json" or a JSON schema
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    mode: str | None = None
    gamma: int | None = None
    branches: int | None = None
    dynamic: bool = False
    ignore_eos: bool = False
    grammar: Grammar | None = None  # a regex, Lark or GBNF grammar (see structured.py)

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs or self.top_logprobs)

    def problems(self, context: int | None) -> list[str]:
        found = self.options.problems(context) if self.options else []
        if self.think not in (None, False):
            found.append("think is not supported: the model has no thinking mode")
        if self.keep_alive is not None and _is_zero(self.keep_alive):
            found.append(
                "keep_alive 0 would unload the model: hetspecd keeps its models "
                "loaded while it runs (stop the daemon to free them)"
            )
        return found

    def wanted_grammar(self) -> Grammar | None:
        return ollama_grammar(self.format, self.grammar)

    def generate_request(
        self, prompt: str, stops: list[str], default_predict: int | None
    ) -> GenerateRequest:
        options = self.options or Options()
        predict = default_predict if options.num_predict is None else options.num_predict
        try:
            return GenerateRequest(
                prompt=prompt,
                max_tokens=None if predict is not None and predict < 0 else predict,
                temperature=options.temperature if options.temperature is not None else 0.0,
                top_k=options.top_k or 0,
                top_p=options.top_p if options.top_p is not None else 1.0,
                seed=options.seed,
                stop=([options.stop] if isinstance(options.stop, str) else options.stop or [])
                + stops,
                stream=self.stream,
                ignore_eos=self.ignore_eos,
                mode=self.mode,
                gamma=self.gamma,
                branches=self.branches,
                dynamic=self.dynamic,
                logprobs=(self.top_logprobs or 0) if self.wants_logprobs else None,
                grammar=self.wanted_grammar(),
            )
        except ValueError as error:
            raise ApiError(400, f"invalid request: {error}") from None


def _is_zero(keep_alive: float | str) -> bool:
    if isinstance(keep_alive, str):
        return bool(_ZERO_DURATION.fullmatch(keep_alive.strip())) and any(
            c.isdigit() for c in keep_alive
        )
    return keep_alive == 0


class GenerateBody(_Body, forbid_unknown_fields=True, kw_only=True):
    prompt: str = ""  # empty: only make sure the model is loaded (done_reason "load")
    system: str | None = None
    raw: bool = False  # True: the prompt as given; False: in the model's chat template
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None

    def problems(self, context: int | None) -> list[str]:
        found = super().problems(context)
        if self.suffix:
            found.append("suffix (fill in the middle) is not supported")
        if self.template:
            found.append(
                "template is not supported: the model's chat template applies, "
                "or none with raw: true"
            )
        if self.context:
            found.append(
                "context (the deprecated token history) is not supported; send "
                "the conversation to /api/chat"
            )
        if self.images:
            found.append("images are not supported: the model reads text only")
        if self.raw and self.system:
            found.append("system needs the chat template, which raw: true leaves out")
        return found


class Message(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: str
    content: str | None = None
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None

    def chat_message(self) -> ChatMessage:
        if self.images:
            raise ValueError("images are not supported: the model reads text only")
        calls = [_called(call) for call in self.tool_calls or []]
        return ChatMessage(
            role=self.role,
            content=self.content or "",
            name=self.tool_name,
            tool_calls=calls or None,
        )


def _called(call: Any) -> MessageToolCall:
    """Ollama's form of a call, ``{"function": {"name", "arguments": {...}}}``, as OpenAI's."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError('a tool_calls entry is {"function": {"name": ..., "arguments": {...}}}')
    arguments = json.dumps(function.get("arguments") or {})
    return MessageToolCall(
        id=str(call.get("id") or ""),
        function=CalledFunction(name=function["name"], arguments=arguments),
    )


class ChatBody(_Body, forbid_unknown_fields=True, kw_only=True):
    messages: list[Message] = []
    tools: list[Tool] | None = None  # OpenAI's tool objects; the answer may call one (auto)

    def __post_init__(self) -> None:
        check_tools(self.tools)
        self.wanted_grammar()  # format, grammar, tools: a 400 now where they conflict

    def tool_use(self) -> ToolUse | None:
        return tool_use(self.tools, None)

    def wanted_grammar(self) -> Grammar | None:
        grammar = super().wanted_grammar()
        use = self.tool_use()
        if use is None:
            return grammar
        if grammar is not None:
            raise ValueError(f"{grammar.field} cannot constrain an answer that may call a tool")
        return use.grammar()


class ReplyFields:
    """What a generation's objects carry of its text: ``field(text)`` for each piece; for
    /api/chat with tools, the text or the call the answer makes, which Ollama sends whole in
    the last object (a call is held back from the pieces)."""

    def __init__(self, field, may_call: bool = False) -> None:
        self.field = field
        self.reader = ReplyReader(must_call=False) if may_call else None
        self.text, self.sent = "", False

    def piece(self, text: str) -> dict | None:
        """A streamed piece's fields (None: nothing to send yet)."""
        if self.reader is None:
            return self.field(text)
        self.text += text
        delta = self.reader.feed(text)
        if delta is None or "tool_calls" in delta:
            return None
        self.sent = True
        return self.field(delta["content"])

    def last(self, text: str, done_reason: str) -> tuple[dict, str]:
        """The last object's fields and ``done_reason``; ``text``: what no piece carried."""
        if self.reader is None:
            return self.field(text), done_reason
        self.text += text
        message, reason = whole_reply(self.text, done_reason, must_call=False)
        if reason != "tool_calls":  # text, or a call cut short: as text
            return self.field("" if self.sent else self.text), done_reason
        calls = [
            {
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.loads(c["function"]["arguments"]),
                }
            }
            for c in message["tool_calls"]
        ]
        return {"message": {"role": "assistant", "content": "", "tool_calls": calls}}, "stop"


class ShowBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str = ""
    name: str | None = None  # Ollama's older field
    verbose: bool = False


def _now() -> str:
    """Ollama's timestamps: RFC 3339 in UTC with microseconds."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(ms: float) -> int:
    return int(ms * 1_000_000)


class OllamaApi:
    def __init__(self, service: Service) -> None:
        self.service = service

    # ------------------------------------------------------------ what a model is

    def served_context(self) -> int | None:
        verifier = self.service.verifier()
        return verifier.ready.context if verifier is not None and verifier.ready else None

    @staticmethod
    def details(facts: ModelFacts) -> dict:
        return {
            "parent_model": "",
            "format": facts.format,
            "family": facts.family,
            "families": [facts.family],
            "parameter_size": facts.parameter_size,
            "quantization_level": facts.quantization,
        }

    async def listing(self) -> dict:
        facts = await self.service.target_facts()
        name = self.service.model_name
        return {
            "name": name,
            "model": name,
            "modified_at": facts.modified.isoformat(),
            "size": facts.size_bytes,
            "digest": facts.digest,
            "details": self.details(facts),
        }

    def parameters(self) -> str:
        """The defaults a request gets, in Ollama's Modelfile form."""
        lines = ["temperature 0", "top_k 0", "top_p 1", f"num_predict {DEFAULT_NUM_PREDICT}"]
        if self.service.chat_template is not None:
            lines += [f'stop "{stop}"' for stop in self.service.chat_template.stops]
        return "\n".join(lines)

    # ------------------------------------------------------------ generation

    def _model(self, body: _Body) -> str:
        return body.model or self.service.model_name

    def _check(self, body: _Body) -> None:
        problems = body.problems(self.served_context())
        if problems:
            raise ApiError(400, "; ".join(problems))

    def _prompt(self, body: GenerateBody) -> tuple[str, list[str]]:
        """The prompt and the implicit stops: Ollama applies the model's template unless raw
        (with no chat template, the prompt is the template's whole output)."""
        template = self.service.chat_template
        if body.raw or template is None:
            if body.system:
                raise ApiError(400, "the target model has no chat template to hold a system prompt")
            return body.prompt, []
        messages = [ChatMessage(role="system", content=body.system)] if body.system else []
        messages.append(ChatMessage(role="user", content=body.prompt))
        return self._render(messages), template.stops

    def _render(self, messages: list[ChatMessage], tools: ToolUse | None = None) -> str:
        self.service.check_chat_size(len(messages))
        try:
            return chat_prompt(self.service.chat_template, messages, tools)
        except ChatTemplateError as error:
            raise ApiError(400, str(error)) from None

    def _final(
        self, run: Run, body: _Body, received: float, done_reason: str | None = None, **fields: Any
    ) -> dict:
        result = run.result
        total_ms = (time.perf_counter() - received) * 1000
        if body.wants_logprobs:  # what no streamed piece carried (not streamed: all)
            fields["logprobs"] = run.unsent_logprobs()
        served = self.served_context()
        asked = body.options.num_ctx if body.options else None
        if asked is not None and served is not None and asked > served:
            fields["served_context"] = served  # front ends ask 8192 whatever the model holds
        return {
            "model": self._model(body),
            "created_at": _now(),
            **fields,
            "done": True,
            "done_reason": done_reason or result.done_reason,
            "total_duration": _ns(total_ms),
            "load_duration": 0,  # the models stay loaded; time in the queue is in the total
            "prompt_eval_count": result.prompt_tokens,
            "prompt_eval_duration": _ns(result.prompt_ms),
            "eval_count": len(result.tokens),
            "eval_duration": _ns(result.decode_ms),
            "id": run.id,  # hetspec's statistics, beside Ollama's
            **run.statistics(),
        }

    async def _respond(
        self,
        request: web.Request,
        body: _Body,
        generate: GenerateRequest,
        reply: ReplyFields,
        received: float,
    ) -> web.StreamResponse:
        """Run one generation; ``reply`` makes the part of an object that carries text
        (``response`` or ``message``)."""
        model = self._model(body)
        async with self.service.generation(generate) as run:
            if not body.stream:
                text = await collect(run)
                fields, reason = reply.last(text, run.result.done_reason)
                return web.json_response(self._final(run, body, received, reason, **fields))

            def piece(text: str) -> bytes:
                fields = reply.piece(text)
                if fields is None:
                    return b""
                chunk = {"model": model, "created_at": _now(), **fields, "done": False}
                if body.wants_logprobs:  # the tokens generated since the last piece
                    chunk["logprobs"] = run.unsent_logprobs()
                return msgspec.json.encode(chunk) + b"\n"

            def end() -> bytes:
                fields, reason = reply.last("", run.result.done_reason)
                final = self._final(run, body, received, reason, **fields)
                return msgspec.json.encode(final) + b"\n"

            def failure(error: ApiError) -> bytes:
                document = {
                    **self._final(run, body, received, **reply.field("")),
                    "done_reason": "error",
                    "error": error.message,
                }
                return msgspec.json.encode(document) + b"\n"

            return await stream(
                request,
                run,
                content_type="application/x-ndjson",
                encode_piece=piece,
                encode_end=end,
                encode_failure=failure,
            )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        body = decode(await request.read(), GenerateBody)
        self._check(body)
        if not body.prompt:  # Ollama's way to load a model: it is loaded already
            if not self.service.ready():
                raise ApiError(503, "the workers are still loading", retry_after_s=5)
            document = {
                "model": self._model(body),
                "created_at": _now(),
                "response": "",
                "done": True,
                "done_reason": "load",
            }
            return web.json_response(document)
        prompt, stops = self._prompt(body)
        generate = body.generate_request(prompt, stops, DEFAULT_NUM_PREDICT)
        reply = ReplyFields(lambda text: {"response": text})
        return await self._respond(request, body, generate, reply, received)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        body = decode(await request.read(), ChatBody)
        self._check(body)
        if self.service.chat_template is None:
            raise ApiError(400, "the target model has no chat template; use /api/generate")
        if not body.messages:
            raise ApiError(400, "messages must hold at least one message")
        try:
            messages = [message.chat_message() for message in body.messages]
        except ValueError as error:
            raise ApiError(400, f"invalid request: {error}") from None
        use = body.tool_use()
        prompt = self._render(messages, use)
        generate = body.generate_request(prompt, self.service.chat_template.stops, None)
        reply = ReplyFields(
            lambda text: {"message": {"role": "assistant", "content": text}}, use is not None
        )
        return await self._respond(request, body, generate, reply, received)

    # ------------------------------------------------------------ models

    async def tags(self, request: web.Request) -> web.Response:
        return web.json_response({"models": [await self.listing()]})

    async def ps(self, request: web.Request) -> web.Response:
        if not self.service.ready():
            return web.json_response({"models": []})
        verifier = self.service.verifier()
        listing = await self.listing()
        on_gpu = verifier.ready.device.startswith("cuda")
        entry = {
            **listing,
            "expires_at": NEVER,
            "size_vram": listing["size"] if on_gpu else 0,
            "context_length": self.served_context(),
        }
        return web.json_response({"models": [entry]})

    async def show(self, request: web.Request) -> web.Response:
        body = decode(await request.read(), ShowBody)
        name = body.model or body.name or ""
        if name != self.service.model_name:
            raise ApiError(
                404, f"model {name!r} not found: this daemon serves {self.service.model_name!r}"
            )
        facts = await self.service.target_facts()
        template = self.service.chat_template
        config = self.service.config
        # tools: /api/chat's answers may call them (tool_calls.py); that needs the chat template
        capabilities = ["completion"] + (["tools"] if template is not None else [])
        parameters = self.parameters()
        modelfile = f"# served by hetspecd {__version__}\nFROM {facts.path}\n" + "".join(
            f"PARAMETER {line}\n" for line in parameters.splitlines()
        )
        return web.json_response(
            {
                "modelfile": modelfile,
                "parameters": parameters,
                # the chat template is Jinja (Hugging Face's), not an Ollama Go template
                "template": template.source if template is not None else "{{ .Prompt }}",
                "details": self.details(facts),
                "model_info": facts.info,
                "capabilities": capabilities,
                "modified_at": facts.modified.isoformat(),
                "hetspec": {
                    "placement": config.placement,
                    "draft": msgspec.to_builtins(config.draft),  # None: no draft model
                    "served_context": self.served_context(),
                },
            }
        )

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def root(self, request: web.Request) -> web.Response:
        """Ollama answers ``GET /`` so that tools can tell it is there."""
        return web.Response(text=f"hetspecd {__version__} is running (Ollama's API under /api/)")

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/api/generate", self.generate),
            web.post("/api/chat", self.chat),
            web.get("/api/tags", self.tags),
            web.post("/api/show", self.show),
            web.get("/api/version", self.version),
            web.get("/api/ps", self.ps),
            web.get("/", self.root),
        ]

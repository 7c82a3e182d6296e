"""The target's tokenizer over HTTP, and the embeddings hetspecd does not serve.

``/tokenize`` and ``/detokenize`` take llama.cpp server's shapes (``content``, ``add_special``,
``with_pieces``; ``tokens``) and vLLM's (``prompt``, ``add_special_tokens``), which
lm-evaluation-harness's remote tokenizer sends after reading ``/tokenizer_info``; the reply
carries both spellings. Text goes through the verifier's own ``Tokenize`` (the prompt's
tokenization); ids come back through the bytes each id stands for (``Ready.token_bytes``).
Embeddings are refused with a 501 that names what to run instead: the target is a generator,
and its hidden states would make poor embeddings for retrieval (docs/api.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from hetspec.daemon.api.errors import ApiError, decode
from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerError
from hetspec.protocol import worker_messages as m

if TYPE_CHECKING:
    from hetspec.daemon.service import Service

EMBEDDINGS_REFUSAL = (
    "embeddings are not served: hetspecd runs a generative model for speculative decoding. "
    "Run an embedding model beside it (llama.cpp: `llama-server --embedding -m "
    "nomic-embed-text-v1.5.Q8_0.gguf`; or Ollama with `nomic-embed-text`) and point the "
    "front end's embedding setting at that server"
)


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    content: str | None = None  # llama.cpp's name
    prompt: str | None = None  # vLLM's
    add_special: bool | None = None  # llama.cpp's (default false)
    add_special_tokens: bool | None = None  # vLLM's (default true)
    with_pieces: bool = False
    model: str | None = None

    def text(self) -> str:
        if (self.content is None) == (self.prompt is None):
            raise ApiError(400, "send the text in content (or prompt), exactly one of them")
        return self.content if self.content is not None else self.prompt

    def special(self) -> bool:
        if self.add_special is not None:
            return self.add_special
        return self.add_special_tokens if self.add_special_tokens is not None else False


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]
    model: str | None = None


def _piece(raw: bytes) -> str | list[int]:
    """llama.cpp's form: the text, or the bytes where they are not whole UTF-8."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return list(raw)


def token_routes(service: Service) -> list[web.RouteDef]:
    def ready_verifier() -> WorkerClient:
        verifier = service.verifier()
        if verifier is None or verifier.ready is None:
            raise ApiError(503, "the target is still loading", retry_after_s=5)
        return verifier

    async def tokenize(request: web.Request) -> web.Response:
        body = decode(await request.read(), TokenizeBody)
        text, verifier = body.text(), ready_verifier()
        try:
            reply, _ = await verifier.call(
                m.Tokenize(request=verifier.next_request(), text=text, add_special=body.special())
            )
        except WorkerError as error:
            raise ApiError(
                503, f"the target could not tokenize: {error}", retry_after_s=2
            ) from None
        tokens = reply.tokens
        if body.with_pieces:
            pieces = [{"id": t, "piece": _piece(verifier.ready.token_bytes[t])} for t in tokens]
            return web.json_response({"tokens": pieces})
        return web.json_response({"tokens": tokens, "count": len(tokens)})

    async def detokenize(request: web.Request) -> web.Response:
        body = decode(await request.read(), DetokenizeBody)
        table = ready_verifier().ready.token_bytes
        outside = next((t for t in body.tokens if not 0 <= t < len(table)), None)
        if outside is not None:
            raise ApiError(
                400, f"tokens: id {outside} is outside the vocabulary (0..{len(table) - 1})"
            )
        text = b"".join(table[t] for t in body.tokens).decode(errors="replace")
        return web.json_response({"content": text, "prompt": text})

    async def tokenizer_info(request: web.Request) -> web.Response:
        ready = ready_verifier().ready
        vocab = ready.vocab

        def text(token: int) -> str | None:
            return ready.token_bytes[token].decode(errors="replace") if token >= 0 else None

        template = service.chat_template
        return web.json_response(
            {
                "eos_token": text(vocab.eos),
                "bos_token": text(vocab.bos),
                "pad_token": None,
                "add_bos_token": vocab.add_bos,
                "model_max_length": ready.context,
                "vocab_size": vocab.size,
                "chat_template": template.source if template is not None else None,
            }
        )

    async def embeddings(request: web.Request) -> web.Response:
        raise ApiError(501, EMBEDDINGS_REFUSAL)

    return [
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
        web.get("/tokenizer_info", tokenizer_info),
        web.post("/v1/embeddings", embeddings),
        web.post("/api/embed", embeddings),
        web.post("/api/embeddings", embeddings),
    ]

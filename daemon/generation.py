"""Generation requests as the daemon runs them today: autoregressive on the target worker.

This is the baseline every speculative mode is measured against and the path the daemon's
supervision is exercised on; the speculative engine (draft on one worker, verify on the other)
replaces the loop below, not the request handling around it.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import numpy as np

from hetspec.daemon.worker_client import WorkerClient
from hetspec.protocol import Arena
from hetspec.protocol import worker_messages as m
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.sampling import distribution
from hetspec.speculative.spare_cores import SpareCoreChoice
from hetspec.speculative.verify import draw

# "autoregressive": the target alone; "sequential": draft, then verify, the budget controller
# choosing gamma unless the request fixes it; "parallel": the drafter drafts the next round while
# the verifier verifies this one, at a fixed gamma; "adaptive": parallel plus the controller
MODES = ("autoregressive", "sequential", "parallel", "adaptive")
# When the target decodes alone (autoregressive mode, rounds without a draft) a call decodes
# as many tokens as take about ALONE_CALL_S of its compute: each call costs ~0.8 ms besides
# (messages, the daemon streaming the tokens; measured on a 2-vCPU VM), and every 16th call
# measures the other core choice (see spare_cores), so few tokens per call cost a slow target
# up to 15%. 50 ms of tokens arriving at once still read as a stream (20 pieces a second), a
# stop string or a client that hangs up wastes at most that.
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


def first_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The token after the prompt, from the prefill's (1, vocab) logits (every mode's)."""
    if params.greedy:
        return int(np.argmax(logits[0]))
    return draw(distribution(logits, params)[0], rng)


MAX_GAMMA = 32
MAX_BRANCHES = 8
MAX_STOPS, MAX_STOP_CHARS = 16, 256


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prompt: str
    max_tokens: int | None = 128  # None: until EOS, a stop, or the end of the context
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] = []  # text that ends generation (not included in the response)
    stream: bool = True
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)
    mode: str | None = None  # one of MODES; None: the daemon's configured mode
    gamma: int | None = None  # a fixed draft length (sequential and parallel modes)
    branches: int | None = None  # with gamma, in sequential mode: a fixed branch count
    # with gamma, in sequential mode: DuoDecoding's uncertainty rule picks the branch count
    # (at most ``branches``, default 4) and the branches share the budget gamma
    dynamic: bool = False

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        for text in (self.prompt, *self.stops):
            check_unicode(text)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in 0..2**63-1, not {self.seed}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= 1_000_000:
            raise ValueError(f"max_tokens must be in 1..1000000, not {self.max_tokens}")
        self.sampling  # noqa: B018 - validates temperature/top_k/top_p
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if len(self.stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in self.stops):
            raise ValueError(f"stop takes at most {MAX_STOPS} strings of at most "
                             f"{MAX_STOP_CHARS} characters")  # fmt: skip
        if self.gamma is not None and not 1 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"gamma must be in 1..{MAX_GAMMA}, not {self.gamma}")
        if self.branches is not None and not 1 <= self.branches <= MAX_BRANCHES:
            raise ValueError(f"branches must be in 1..{MAX_BRANCHES}, not {self.branches}")
        if self.mode is not None:
            self.resolve_mode(self.mode)

    def resolve_mode(self, default: str) -> str:
        """The mode this request runs in, given the daemon's configured one."""
        mode = self.mode or default
        if self.gamma is not None and mode in ("autoregressive", "adaptive"):
            raise ValueError(f"gamma fixes the draft length, which mode {mode!r} does not "
                             "use; use mode 'parallel' or 'sequential'")  # fmt: skip
        if self.branches is not None and (mode != "sequential" or self.gamma is None):
            raise ValueError("branches fixes the branch count of mode 'sequential' and needs "
                             f"gamma as well (mode {mode!r}, gamma {self.gamma})")  # fmt: skip
        if self.dynamic and (mode != "sequential" or self.gamma is None):
            raise ValueError("dynamic drafts mode 'sequential' by the uncertainty rule and "
                             f"needs gamma (mode {mode!r}, gamma {self.gamma})")  # fmt: skip
        return mode

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


def check_unicode(text: str) -> None:
    """JSON can carry lone surrogates (``"\\ud800"``), which no tokenizer can encode."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError(f"text contains a lone surrogate: {text[:40]!r}") from None


def token_budget(request: GenerateRequest, prompt_tokens: int, context: int, room: int = 0) -> int:
    """How many tokens the request may generate: its ``max_tokens``, or what the context
    leaves when it gives none; ``room`` is kept free (for a draft tree on top of the text)."""
    left = context - prompt_tokens - room
    if request.max_tokens is None:
        if left < 1:
            raise ValueError(f"the prompt has {prompt_tokens} tokens, which leaves no room "
                             f"in the {context}-token context")  # fmt: skip
        return left
    if request.max_tokens > left:
        extra = f" and room for a draft tree ({room})" if room else ""
        raise ValueError(f"the prompt has {prompt_tokens} tokens; with max_tokens "
                         f"{request.max_tokens}{extra} that exceeds the {context}-token "
                         "context")  # fmt: skip
    return request.max_tokens


class Detokenizer:
    """Token ids to text, piece by piece, never splitting a UTF-8 character across pieces."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self._bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._decoder.decode(self._bytes[token])

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class TextOutput:
    """A request's verified tokens as the text it streams: detokenized piece by piece, with
    text that could begin a stop string held back until it is known not to; at a stop string
    the text ends just before it and ``stopped`` is set (the token that completed it is the
    last one generated)."""

    def __init__(self, token_bytes: list[bytes], stops: list[str]) -> None:
        self._detokenizer = Detokenizer(token_bytes)
        self._stops = [stop for stop in stops if stop]
        self._held = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """The text that may be sent now that ``token`` was generated."""
        return self._release(self._detokenizer.add(token))

    def flush(self) -> str:
        """What is left at the end of generation (nothing after a stop string)."""
        if self.stopped:
            return ""
        text, self._held = self._held + self._detokenizer.flush(), ""
        return text

    def _release(self, piece: str) -> str:
        text = self._held + piece
        found = [(text.find(stop), stop) for stop in self._stops if stop in text]
        if found:
            self.stopped, self._held = True, ""
            return text[: min(at for at, _ in found)]
        keep = max((n for stop in self._stops for n in range(1, len(stop))
                    if text.endswith(stop[:n])), default=0)  # fmt: skip
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    done_reason: str = "length"
    started: float = field(default_factory=time.perf_counter)  # when the request began
    ttft_ms: float | None = None  # request start to the first verified token

    def add(self, token: int) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.started) * 1000
        self.tokens.append(token)


async def generate(
    request: GenerateRequest,
    worker: WorkerClient,
    slot: int,
    result: GenerationResult,
    *,
    arena: Arena,
    cores: SpareCoreChoice,
) -> AsyncIterator[str]:
    """Yield text pieces; ``result`` holds the tokens and timings (complete when exhausted).
    The first token is chosen here from the prefill's logits (in arena slot ``slot``), as the
    speculative modes choose theirs: no call of its own. Then several tokens per call
    (``alone_tokens``, ``Decode``): the worker evaluates the last call's last token and draws
    the next ones, one forward each, committing them as it goes. The drafter has nothing to
    do in this mode: the target computes on its cores too, where ``cores`` finds that this
    pays."""
    ready = worker.ready
    started = time.perf_counter()
    tokenized, _ = await worker.call(m.Tokenize(request=worker.next_request(), text=request.prompt))
    prompt = tokenized.tokens
    max_tokens = token_budget(request, len(prompt), ready.context)
    prefilled, _ = await worker.call(
        m.Prefill(request=worker.next_request(), tokens=prompt, seed=request.seed, out=slot,
                  spare_cores=cores.preferred())
    )  # fmt: skip
    # the daemon's draw of the first token: a stream apart from the worker's, same seed
    rng = np.random.default_rng(None if request.seed is None else request.seed ^ 0x1F7)
    tokens = [first_token(arena.view(prefilled.logits), request.sampling, rng)]
    result.prompt_tokens = len(prompt)
    result.prompt_ms = (time.perf_counter() - started) * 1000
    decode_start = time.perf_counter()
    output = TextOutput(ready.token_bytes, request.stops)
    eos = -1 if request.ignore_eos else ready.vocab.eos
    token_s = cores.cost_s()  # the worker's seconds per token, from the last call
    try:
        while True:
            pieces = []  # one write per call, not per token
            for token in tokens:
                if token == eos:
                    result.done_reason = "stop"
                    break
                result.add(token)
                pieces.append(output.add(token))
                if output.stopped:
                    result.done_reason = "stop"
                    break
            if any(pieces):
                yield "".join(pieces)
            if len(result.tokens) >= max_tokens or result.done_reason == "stop":
                break
            wide = cores.choose()
            steps = alone_tokens(token_s, trial=cores.exploring)
            decoded, _ = await worker.call(
                m.Decode(
                    request=worker.next_request(),
                    steps=min(steps, max_tokens - len(result.tokens)),
                    sampling=request.sampling,
                    append=tokens[-1:],  # the last call's last token: drawn, not evaluated
                    spare_cores=wide,
                )
            )
            tokens = decoded.tokens
            token_s = decoded.elapsed_ms / 1000 / len(tokens)
            cores.record(wide, token_s)
        tail = output.flush()
        if tail:
            yield tail
    finally:
        result.decode_ms = (time.perf_counter() - decode_start) * 1000

"""A generation request as the API takes it, and what the daemon reports of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from hetspec.protocol.modes import MODES
from hetspec.protocol.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob
from hetspec.protocol.vocab import VocabInfo
from hetspec.speculative.constrain.grammars import Grammar, GrammarError

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
    # each generated token's log-probability under the target, with this many alternatives
    logprobs: int | None = None
    # the prompt as the target's token ids, used as given (``prompt`` is then ignored)
    prompt_tokens: list[int] | None = None
    # with logprobs: each prompt token's too, after the first (``GenerationResult``'s)
    prompt_logprobs: bool = False
    # structured output: every emitted token keeps the text valid under this grammar
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        self._check_prompt()
        self._check_grammar()
        for text in (self.prompt, *self.stops):
            check_unicode(text)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in 0..2**63-1, not {self.seed}")
        # 0: the prompt's prefill alone (its log-probabilities, an echo)
        if self.max_tokens is not None and not 0 <= self.max_tokens <= 1_000_000:
            raise ValueError(f"max_tokens must be in 0..1000000, not {self.max_tokens}")
        self.sampling  # noqa: B018 - validates temperature/top_k/top_p
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if len(self.stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in self.stops):
            raise ValueError(
                f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters"
            )
        if self.gamma is not None and not 1 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"gamma must be in 1..{MAX_GAMMA}, not {self.gamma}")
        if self.branches is not None and not 1 <= self.branches <= MAX_BRANCHES:
            raise ValueError(f"branches must be in 1..{MAX_BRANCHES}, not {self.branches}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"logprobs: top log-probabilities must be 0..{MAX_TOP_LOGPROBS}, "
                f"not {self.logprobs}"
            )
        if self.mode is not None:
            self.resolve_mode(self.mode)

    def _check_grammar(self) -> None:
        if self.grammar is None:
            return
        try:
            self.grammar.text()
        except GrammarError as error:
            raise ValueError(f"{self.grammar.field}: {error}") from None
        if self.ignore_eos:
            raise ValueError(
                "ignore_eos cannot be combined with a grammar: the grammar says where the "
                "output may end"
            )

    def _check_prompt(self) -> None:
        if self.prompt_tokens is not None:
            if not self.prompt_tokens:
                raise ValueError("prompt must hold at least one token id")
        elif not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.prompt_logprobs and self.logprobs is None:
            raise ValueError("the prompt's log-probabilities need logprobs (0..20)")

    def resolve_mode(self, default: str) -> str:
        """The mode this request runs in, given the daemon's configured one."""
        mode = self.mode or default
        if self.gamma is not None and mode in ("autoregressive", "adaptive"):
            raise ValueError(
                f"gamma fixes the draft length, which mode {mode!r} does not "
                "use; use mode 'parallel' or 'sequential'"
            )
        if self.branches is not None and (mode != "sequential" or self.gamma is None):
            raise ValueError(
                "branches fixes the branch count of mode 'sequential' and needs "
                f"gamma as well (mode {mode!r}, gamma {self.gamma})"
            )
        if self.dynamic and (mode != "sequential" or self.gamma is None):
            raise ValueError(
                "dynamic drafts mode 'sequential' by the uncertainty rule and "
                f"needs gamma (mode {mode!r}, gamma {self.gamma})"
            )
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


def end_ids(request: GenerateRequest, vocab: VocabInfo) -> frozenset[int]:
    """The ids that end this request's generation: the target's EOS and end-of-turn tokens,
    none with ``ignore_eos``."""
    if request.ignore_eos:
        return frozenset()
    return frozenset({vocab.eos, *vocab.ends} - {-1})


def cut_at_end(tokens: list[int], ends: frozenset[int]) -> tuple[list[int], bool]:
    """``tokens`` up to the first that ends generation (not included), and whether one did."""
    for index, token in enumerate(tokens):
        if token in ends:
            return tokens[:index], True
    return tokens, False


def check_messages_fit(count: int, context: int) -> None:
    """Refuse (ValueError) a chat of more messages than the context has tokens (each message
    takes at least one) before its template is rendered."""
    if count > context:
        raise ValueError(f"{count:,} messages cannot fit the {context}-token context")


def token_budget(request: GenerateRequest, prompt_tokens: int, context: int, room: int = 0) -> int:
    """How many tokens the request may generate: its ``max_tokens``, or what the context
    leaves when it gives none; ``room`` is kept free (for a draft tree on top of the text)."""
    left = context - prompt_tokens - room
    if request.max_tokens is None:
        if left < 1:
            raise ValueError(
                f"the prompt has {prompt_tokens} tokens, which leaves no room "
                f"in the {context}-token context"
            )
        return left
    if request.max_tokens > left:
        extra = f" and room for a draft tree ({room})" if room else ""
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens; with max_tokens "
            f"{request.max_tokens}{extra} that exceeds the {context}-token "
            "context"
        )
    return request.max_tokens


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    done_reason: str = "length"
    started: float = field(default_factory=time.perf_counter)  # when the request began
    ttft_ms: float | None = None  # request start to the first verified token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as the target read it
    # with GenerateRequest.prompt_logprobs: one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, token: int, logprob: TokenLogprob | None = None) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.started) * 1000
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)

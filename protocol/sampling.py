"""How a request wants its tokens drawn; travels from the client through the daemon to workers."""

from __future__ import annotations

import math

import msgspec


class SamplingError(ValueError):
    """Sampling parameters out of range; the message says which and what is allowed."""


# A sampled request's temperature: below the floor logits / T overflow float32; above the
# ceiling every token is as likely as any other to within float32's precision anyway.
TEMPERATURE_RANGE = (0.001, 100.0)


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``temperature == 0`` is greedy decoding; ``top_k == 0`` and ``top_p == 1`` switch off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        low, high = TEMPERATURE_RANGE
        if not (self.temperature == 0 or low <= self.temperature <= high):
            raise SamplingError(
                f"temperature must be 0 (greedy) or in {low}..{high}, not {self.temperature}"
            )
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), not {self.top_k}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1], not {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


MAX_TOP_LOGPROBS = 20


class TokenLogprob(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A generated token's log-probability under the target's own distribution (the softmax
    of its logits: no temperature, no truncation), with the ``top`` most likely tokens as
    (id, log-probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = []

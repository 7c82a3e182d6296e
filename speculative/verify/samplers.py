"""Where a sampled token's randomness comes from: drawn in order, or keyed by its position.

- ``DrawnSampler``: one generator, draws taken in the order tokens are chosen. Standard
  speculative sampling needs this (independent uniforms to judge each drafted token), but the
  text then depends on how many draws came before: on the mode, on the draft length the
  controller chose, on timing.
- ``KeyedSampler``: the token at position t is the Gumbel-max choice argmax(log p_t + g_t),
  with g_t derived from (seed, t) alone by a counter-based generator (Philox, key = seed,
  counter = t). Both workers and the daemon derive the same g_t, so the drafter proposes with
  the verifier's own noise, a drafted token is accepted exactly when it is the target's choice,
  and the text is what the target alone samples with that seed, in every mode. Each token is
  still an exact sample of p_t given the prefix: g_t is independent of everything before t.
  It is computed in its exponential-race form, argmax(p_t / e_t) with e_t = exp(-g_t) =
  -log(u_t) ~ Exp(1): the same choice with one logarithm per token instead of three.

Both choose one token per probability row (rows after temperature, top-k and top-p; see
``sampling.distribution``); greedy decoding takes the argmax and needs neither.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.verify.distributions import draw_rows, top_tokens

NOISE_CACHE = 64  # positions kept: a round's tree and the next draft reuse the same ones


@dataclass(frozen=True)
class ChainDraws:
    """How a chain's sampled tokens are chosen from their probability rows p where one call
    drafts the chain (the native kernels' ``hs_draft_chain``): with ``noise`` (count, vocab)
    float32 > 0, argmax(p / noise), an exponential race (keyed noise: the keyed choice); with
    ``uniforms`` (count,) float64 in [0, 1), the first token whose cumulative probability
    exceeds u times the row's total, as ``sampling.draw`` draws."""

    noise: np.ndarray | None = None
    uniforms: np.ndarray | None = None


class Sampler(Protocol):
    def choose(self, rows: np.ndarray, position: int) -> np.ndarray:
        """One token per probability row of shape (n, vocab); all n rows choose the token at
        ``position`` (sibling branches, or rows of the same depth)."""
        ...

    def candidates(self, row: np.ndarray, position: int, count: int) -> np.ndarray:
        """``count`` proposals for the token at ``position`` from one probability row, the
        first being ``choose``'s (a draft's sibling branches)."""
        ...

    def chain_draws(self, position: int, count: int, vocab: int) -> ChainDraws:
        """How the tokens at ``position`` .. + count - 1 of a draft chain drafted in one call
        are chosen from their probability rows: as ``choose`` would choose them."""
        ...


class DrawnSampler:
    """Draws in order from one generator (seeded by ``seed``; None: from the OS)."""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = np.random.default_rng(seed)

    def choose(self, rows: np.ndarray, position: int) -> np.ndarray:
        return draw_rows(rows.reshape(-1, rows.shape[-1]), self.rng)

    def candidates(self, row: np.ndarray, position: int, count: int) -> np.ndarray:
        """Independent draws: what multi-candidate speculative sampling requires."""
        return draw_rows(np.broadcast_to(row, (count, row.shape[-1])), self.rng)

    def chain_draws(self, position: int, count: int, vocab: int) -> ChainDraws:
        """A uniform a token, from the same generator as ``choose``'s draws."""
        return ChainDraws(uniforms=self.rng.random(count))


class PhiloxNoise:
    """The exponential noise e = -log(u) of each position, keyed by (seed, position), from one
    reusable Philox bit generator: its counter is set to [0, position, 0, 0] per position (each
    owns 2**64 counter blocks), a tenth of the cost of building a generator. Uniforms are the
    midpoints of 2**23 cells (two per 64-bit output; 23 bits, so that float32 holds every
    midpoint): never 0 or 1, and a token's probability moves by less than 1e-6."""

    def __init__(self, seed: int) -> None:
        self._bits = np.random.Philox(key=seed)
        self._key = self._bits.state["state"]["key"]

    def __call__(self, position: int, vocab: int) -> np.ndarray:
        """(vocab,) float32 > 0, the same in every process; a shorter vocabulary (a drafter's
        table may be a little smaller) gets a prefix of the same noise."""
        self._bits.state = {
            "bit_generator": "Philox",
            "buffer": np.zeros(4, np.uint64),
            "buffer_pos": 4,
            "state": {"counter": np.array([0, position, 0, 0], np.uint64), "key": self._key},
            "has_uint32": 0,
            "uinteger": 0,
        }
        raw = self._bits.random_raw((vocab + 1) // 2).view(np.uint32)[:vocab]
        noise = (raw >> 9).astype(np.float32)
        noise += np.float32(0.5)
        noise *= np.float32(2**-23)  # uniform in (0, 1)
        np.log(noise, out=noise)
        return np.negative(noise, out=noise)


class KeyedSampler:
    """Gumbel-max choices with noise keyed by (``seed``, position)."""

    def __init__(self, seed: int) -> None:
        if not 0 <= seed < 2**128:
            raise ValueError(f"a keyed seed must be in 0..2**128-1, not {seed}")
        self._derive = PhiloxNoise(seed)
        self._noise: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def noise(self, position: int, vocab: int) -> np.ndarray:
        key = (position, vocab)
        noise = self._noise.get(key)
        if noise is None:
            noise = self._noise[key] = self._derive(position, vocab)
            if len(self._noise) > NOISE_CACHE:
                self._noise.popitem(last=False)
        return noise

    def scores(self, rows: np.ndarray, positions) -> np.ndarray:
        """rows / the noise of each row's position: the argmax of a row is its choice (a token
        top-k or top-p removed scores 0, never above a token it kept). ``positions``: one per
        row, or one for all."""
        rows = rows.reshape(-1, rows.shape[-1])
        vocab = rows.shape[-1]
        if np.ndim(positions) == 0:
            return rows / self.noise(int(positions), vocab)
        scores = np.empty(rows.shape, np.float32)
        for index, position in enumerate(np.asarray(positions).tolist()):
            np.divide(rows[index], self.noise(position, vocab), out=scores[index])
        return scores

    def choose(self, rows: np.ndarray, position: int) -> np.ndarray:
        return self.scores(rows, position).argmax(axis=-1)

    def candidates(self, row: np.ndarray, position: int, count: int) -> np.ndarray:
        """The ``count`` best perturbed scores: the choice, then the runners-up."""
        return top_tokens(self.scores(row, position)[0], count)

    def chain_draws(self, position: int, count: int, vocab: int) -> ChainDraws:
        """Each position's keyed noise: argmax(p / noise) is ``choose``'s token."""
        return ChainDraws(noise=np.stack([self.noise(position + i, vocab) for i in range(count)]))


def pick(rows: np.ndarray, params: SamplingParams, sampler: Sampler, position: int) -> np.ndarray:
    """One token per row for the token at ``position``: the argmax when greedy."""
    if params.greedy:
        return rows.reshape(-1, rows.shape[-1]).argmax(axis=-1)
    return sampler.choose(rows, position)


def proposals(
    row: np.ndarray, params: SamplingParams, sampler: Sampler, position: int, count: int
) -> np.ndarray:
    """``count`` first tokens of sibling branches: the best ones when greedy."""
    if params.greedy:
        return top_tokens(row, count)
    return sampler.candidates(row, position, count)


def sampler_for(seed: int | None) -> Sampler:
    """A seeded request's tokens are keyed by position (the same text in every mode); an
    unseeded one draws in order (standard speculative sampling, which accepts more)."""
    return DrawnSampler() if seed is None else KeyedSampler(seed)

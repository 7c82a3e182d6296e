"""How a chain drafted on the device chooses each next token, without the host.

``TreeRuntime`` chooses a draft's tokens on the host from each step's logits; a chain whose
forwards run back to back on a GPU (``TorchRuntime._run_chain``, greedy ``decode``) chooses
them on the device instead, the same way: the argmax, or as the sampler's ``ChainDraws`` say.
"""

from __future__ import annotations

import torch

from hetspec.speculative.verify.samplers import ChainDraws

# A sampled choice this close to another is left to the host: the runner-up's score within
# this fraction of the best (noise), or the draw's threshold within this fraction of the total
# mass of a cumulative step (uniforms). The device's softmax differs from the host's by a few
# units in the last place of float32 (its exp and its sum's order), orders of magnitude less.
MARGIN = 1e-4


class DeviceChoice:
    """The token after each of a chain's ``count`` logits rows, on ``device``: the argmax
    (``draws`` None), or from p = softmax(logits / ``temperature``) as ``ChainDraws`` defines
    (argmax(p / noise), or the first token whose cumulative p exceeds u times the total).
    ``probs`` keeps the rows sampled tokens came from, ``count`` x ``vocab`` (None when
    greedy). ``guarded``: ``safe[step]`` says whether the host, computing p from the same
    logits with numpy (``sampling.distribution``), is sure to choose the same token (a
    sampled choice not within ``MARGIN`` of another); a draft needs no such guard (the
    verifier judges its tokens by the rows it reports), the target's own choices do."""

    def __init__(
        self,
        draws: ChainDraws | None = None,
        temperature: float = 1.0,
        *,
        count: int = 0,
        vocab: int = 0,
        device: torch.device | None = None,
        guarded: bool = False,
    ) -> None:
        self.temperature = temperature
        self.probs: torch.Tensor | None = None
        self.safe: torch.Tensor | None = None
        self._noise = self._uniforms = None
        if draws is None:
            return
        if draws.noise is None and draws.uniforms is None:
            raise ValueError("chain draws need noise or uniforms")
        self.probs = torch.empty((count, vocab), dtype=torch.float32, device=device)
        if guarded:
            self.safe = torch.ones(count, dtype=torch.bool, device=device)
        if draws.noise is not None:
            self._noise = torch.from_numpy(draws.noise[:count, :vocab]).to(device)
        else:
            self._uniforms = torch.from_numpy(draws.uniforms[:count]).to(device)

    def __call__(self, step: int, logits: torch.Tensor) -> torch.Tensor:
        """The (1,) int64 token chosen from ``logits`` (vocab,) float32, row ``step``."""
        if self.probs is None:
            return logits.argmax().view(1)
        probs = self.probs[step]
        probs.copy_(torch.softmax(logits / self.temperature, dim=-1))
        if self._noise is not None:
            scores = probs / self._noise[step]
            if self.safe is None:
                return scores.argmax().view(1)
            best = torch.topk(scores, min(2, len(scores)))
            if len(scores) > 1:
                self.safe[step] = best.values[0] > best.values[1] * (1 + MARGIN)
            return best.indices[:1]
        cumulative = torch.cumsum(probs, dim=0, dtype=torch.float64)
        threshold = cumulative[-1:] * self._uniforms[step]
        index = torch.searchsorted(cumulative, threshold, right=True)
        index.clamp_(max=len(cumulative) - 1)  # round-off must not land past the end
        if self.safe is not None:
            margin = cumulative[-1] * MARGIN
            below = torch.where(index > 0, cumulative[(index - 1).clamp(min=0)], 0.0)
            room = torch.minimum(threshold - below, cumulative[index] - threshold)
            self.safe[step] = room[0] > margin
        return index

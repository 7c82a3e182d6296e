"""How a chain drafted on the device chooses each next token, without the host.

``TreeRuntime`` chooses a draft's tokens on the host from each step's logits; a chain whose
forwards run back to back on a GPU (``TorchRuntime._run_chain``, greedy ``decode``) chooses
them on the device instead, the same way: the argmax, or as the sampler's ``ChainDraws`` say.
"""

from __future__ import annotations

import torch

from hetspec.speculative.samplers import ChainDraws


class DeviceChoice:
    """The token after each of a chain's ``count`` logits rows, on ``device``: the argmax
    (``draws`` None), or from p = softmax(logits / ``temperature``) as ``ChainDraws`` defines
    (argmax(p / noise), or the first token whose cumulative p exceeds u times the total).
    ``probs`` keeps the rows sampled tokens came from, ``count`` x ``vocab`` (None when
    greedy)."""

    def __init__(
        self, draws: ChainDraws | None = None, temperature: float = 1.0, *, count: int = 0,
        vocab: int = 0, device: torch.device | None = None,
    ) -> None:  # fmt: skip
        self.temperature = temperature
        self.probs: torch.Tensor | None = None
        self._noise = self._uniforms = None
        if draws is None:
            return
        if draws.noise is None and draws.uniforms is None:
            raise ValueError("chain draws need noise or uniforms")
        self.probs = torch.empty((count, vocab), dtype=torch.float32, device=device)
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
            return (probs / self._noise[step]).argmax().view(1)
        cumulative = torch.cumsum(probs, dim=0, dtype=torch.float64)
        threshold = cumulative[-1:] * self._uniforms[step]
        index = torch.searchsorted(cumulative, threshold, right=True)
        return index.clamp_(max=len(cumulative) - 1)  # round-off must not land past the end

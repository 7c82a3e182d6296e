"""Chains on the device: a torch runtime's chain of forwards queued back to back, each next
token chosen on the device (device_choice.py), the host waiting once at the end.

``DeviceChains`` is the layer of ``TorchRuntime`` above ``torch_forwards.TorchForwards``. It
fills ``TreeRuntime``'s optional ``_run_chain`` hook (a draft chain in one call) and overrides
``decode`` (the target alone), both only where the forwards run in fixed shapes.

Contract: every forward queued here is the one ``_evaluate`` would run for that node on its
own (``_one_row_forwards``), so the tokens, logits and pending tree are bit for bit those of
``TreeRuntime``'s step-by-step loop; a sampled choice the device cannot make as the host would
(``DeviceChoice.safe``) is left to the host, and decoding goes on from there. Without fixed
shapes (``_static`` None), for fewer than two tokens or with a truncating sampler (top-k,
top-p), ``decode`` is ``TreeRuntime.decode``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import replace

import numpy as np
import torch

from hetspec.protocol.sampling import TokenLogprob
from hetspec.speculative.constrain.constraint import Constraint
from hetspec.speculative.verify.distributions import SamplingParams, distribution
from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.speculative.verify.samplers import ChainDraws, Sampler
from hetspec.speculative.verify.tree import ROOT
from hetspec.workers.runtimes.torch_runtime.device_choice import DeviceChoice
from hetspec.workers.runtimes.torch_runtime.static_forward import Batch, StaticForward
from hetspec.workers.runtimes.torch_runtime.torch_forwards import TorchForwards, TreeOutput


class DeviceChains(TorchForwards):
    """``TorchForwards`` with chains of forwards chosen on the device."""

    @torch.inference_mode()
    def _run_chain(
        self,
        first: int,
        positions: np.ndarray,
        rows: np.ndarray,
        draws: ChainDraws | None,
        temperature: float,
        *,
        probs_out: np.ndarray | None = None,
    ):
        """``TreeRuntime``'s hook: a draft chain's forwards back to back on the device, each
        next token chosen there (``DeviceChoice``), one wait for the device at the end."""
        existing = self.pending
        ancestors = np.flatnonzero(rows[0, :existing])  # pending nodes precede descendants
        root = int(ancestors[-1]) if len(ancestors) else ROOT
        count = len(positions)
        parents = np.array([root, *range(existing, existing + count - 1)], np.int64)
        choice = DeviceChoice(
            draws, temperature, count=count, vocab=self.vocab_size, device=self.device
        )
        tokens, logits, hidden = self._chained_forwards(first, positions, parents, rows, choice)
        self._capture_hidden(hidden)
        probs = None if choice.probs is None else choice.probs.cpu().numpy()
        return tokens.cpu().numpy(), TreeOutput(logits, hidden), probs

    def decode(
        self,
        steps: int,
        params: SamplingParams,
        sampler: Sampler,
        *,
        logprobs: list[TokenLogprob] | None = None,
        top: int = 0,
        grammar: Constraint | None = None,
        ends: Collection[int] = (),
    ) -> list[int]:
        """``TreeRuntime.decode``; in fixed shapes the forwards run back to back on the
        device, each next token chosen there (the same bits: each forward is the one
        ``TreeRuntime.decode`` would run), and the host waits once. Greedy: the argmax.
        Sampled at a temperature alone: as the sampler's ``ChainDraws`` say, each choice
        guarded (``DeviceChoice.safe``): from the first one the host might have made
        otherwise, the host chooses and decoding goes on from there, so the tokens are the
        host loop's. Truncating samplers (top-k, top-p) and a grammar (its masks are the
        host's) decode in the host's loop, which also stops at ``ends`` (the device's chains
        run their steps whatever they draw)."""
        truncates = 0 < params.top_k < self.vocab_size or params.top_p < 1
        host = grammar is not None or (not params.greedy and truncates)
        if steps < 2 or self._static is None or host:
            return super().decode(
                steps, params, sampler, logprobs=logprobs, top=top, grammar=grammar, ends=ends
            )
        self.discard_pending()
        before = self.last_logits()
        if params.greedy:
            first, choice = int(before.argmax()), DeviceChoice()
        else:
            position = self.committed
            first = int(sampler.choose(distribution(before[None], params), position)[0])
            draws = sampler.chain_draws(position + 1, steps - 1, self.vocab_size)
            choice = DeviceChoice(
                draws,
                params.temperature,
                count=steps - 1,
                vocab=self.vocab_size,
                device=self.device,
                guarded=True,
            )
        count = steps - 1
        self._checked_tokens([first], count)
        positions = self.committed + np.arange(count)
        parents = np.arange(-1, count - 1)
        rows = np.tril(np.ones((count, count), bool))
        with torch.inference_mode():
            tokens, logits, hidden = self._chained_forwards(first, positions, parents, rows, choice)
            drawn = tokens.tolist()  # the one wait for the device
            # forwards evaluated drawn[:count]; from the first unsafe choice on, the host's
            unsafe = [] if choice.safe is None else np.flatnonzero(~choice.safe.cpu().numpy())
            done = len(unsafe) == 0
            kept = count if done else int(unsafe[0]) + 1
            self._capture_hidden(hidden[:kept])
            rows_after = (
                (logits[:kept] if logprobs is not None else logits[kept - 1 : kept]).cpu().numpy()
            )
        drawn = drawn[: kept + done]
        if logprobs is not None:  # each drawn token's row is the one before it
            for row, token in zip([before, *rows_after], drawn, strict=False):
                logprobs.append(token_logprob(row, token, top))
        self.tokens.extend(drawn[:kept])
        self._last_logits = rows_after[-1].copy()
        if done:
            return drawn
        return drawn + self.decode(steps - kept, params, sampler, logprobs=logprobs, top=top)

    def _chained_forwards(
        self,
        first: int,
        positions: np.ndarray,
        parents: np.ndarray,
        rows: np.ndarray,
        choose: DeviceChoice,
    ):
        """New nodes of one chain (``parents``, ``rows``: as ``_evaluate`` takes them) in one
        forward each, the first holding ``first``, each next one ``choose``'s token from the
        logits of the one before, so the host queues forwards without waiting for them. The
        count + 1 tokens, (count, vocab) float32 logits and (count, hidden) states, on the
        device."""
        count = len(positions)
        static, batches = self._one_row_forwards(positions, parents, rows)
        tokens = torch.empty(count + 1, dtype=torch.int64, device=self.device)
        tokens[0] = first
        logits = torch.empty((count, self.vocab_size), device=self.device)
        hidden = torch.empty((count, self.config.hidden_size), dtype=self.dtype, device=self.device)
        for step, batch in enumerate(batches):
            row = replace(batch, tokens=np.zeros(1, np.int64))  # its token: tokens[step]
            out_logits, out_hidden = self._forward_batch(static, row, tokens[step : step + 1])
            logits[step].copy_(out_logits[0])
            hidden[step].copy_(out_hidden[0])
            tokens[step + 1 : step + 2].copy_(choose(step, logits[step]))
        return tokens, logits, hidden

    def _one_row_forwards(
        self, positions: np.ndarray, parents: np.ndarray, rows: np.ndarray
    ) -> tuple[StaticForward, Iterator[Batch]]:
        """The forwards ``_evaluate`` would run for these nodes one at a time, and what runs
        them."""
        batches = self._split_plan(positions, parents, most_rows=1)
        if batches is not None:
            return self._split, (batch for _, batch in batches)
        batches = self._in_place_batches(positions, parents, most_rows=1)
        if batches is not None:
            return self._in_place, (batch for _, batch in batches)
        return self._static, self._single_rows(self._static, positions, parents, rows)

    def _single_rows(
        self, static: StaticForward, positions: np.ndarray, parents: np.ndarray, rows: np.ndarray
    ) -> Iterator[Batch]:
        """The forwards ``_evaluate`` would run for these nodes one at a time."""
        if static.shapes.paths:
            for _, batch in self._invariant_batches(static, positions, parents, most_rows=1):
                yield batch
            return
        ((_, batch),) = self._bucket_batches(static, positions, rows)
        for i, slot in enumerate(batch.slots):
            one, span = slice(i, i + 1), static.shapes.span_for(int(slot) + 1)
            yield replace(
                batch,
                positions=batch.positions[one],
                slots=batch.slots[one],
                masks=[mask[one, :span] for mask in batch.masks],
                span=span,
            )

"""The forwards of a torch runtime: built at load over its one KV cache, and run.

``TorchForwards`` is the layer of ``TorchRuntime`` above ``forward_plans.ForwardPlans``. At
load (``_build_forwards``) it makes the fixed shapes' forwards (static_forward.py): the
width-invariant gathered ones (``_static``), beside them the one-path ones (``_chains``) and
those that read the cache in place (``_in_place``, kept only where their bits are the one-path
ones'), or split attention's (``_split``, in its Triton kernel where that serves). Each call
(``_evaluate``) runs the plans ``ForwardPlans`` makes in them, or without fixed shapes calls
the model eagerly with attention masks (``_hidden``).

Contract: ``_evaluate`` returns the float32 logits and last hidden states of new nodes, in
the nodes' order, on the runtime's device, their keys/values written to the cache slots after
the pending ones; it changes none of the pending tree's bookkeeping (``TreeRuntime``'s).
``TorchRuntime.__init__`` sets what these read: ``model``, ``_run_model``, ``config``,
``device``, ``dtype``, the cache (``_keys``, ``_values``) and RoPE tables (``_cos``, ``_sin``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

from hetspec.workers.runtimes.torch_runtime import skinny_matmul
from hetspec.workers.runtimes.torch_runtime.forward_plans import ForwardPlans
from hetspec.workers.runtimes.torch_runtime.static_forward import (
    Batch,
    Shapes,
    StaticForward,
    failure,
    in_cache_order,
    kernel_problem,
    same_bits_in_place,
)


@dataclass(frozen=True)
class TreeOutput:
    logits: torch.Tensor  # (nodes, vocab) float32, on the runtime's device
    hidden: torch.Tensor  # (nodes, hidden) last decoder layer output, before the final norm


class TorchForwards(ForwardPlans[TreeOutput]):
    """``ForwardPlans`` with the forwards that run them."""

    _static: StaticForward | None
    _chains: StaticForward | None
    split_kernel_refused: str | None

    # ------------------------------------------------------------ forwards built at load

    def _build_forwards(
        self,
        shapes: Shapes,
        capacity: int,
        *,
        graphs: bool,
        compiled: bool,
        chains: bool,
        in_place: bool,
        split: bool,
    ) -> None:
        """The fixed shapes' forwards, all over the one cache: ``shapes``; with ``chains`` the
        one-path shapes beside them, and with ``in_place`` those that read the cache in place,
        kept where ``same_bits_in_place`` finds their bits the one-path shapes'. With
        ``split`` the split-attention shapes instead, ``shapes`` eager for rows too deep."""
        forwards = partial(
            StaticForward,
            self.model,
            self.config,
            keys=self._keys,
            values=self._values,
            cos=self._cos,
            sin=self._sin,
            capacity=capacity,
        )
        if split:
            self._split = self._split_forwards(
                forwards, shapes.split(), graphs=graphs, compiled=compiled
            )
            self._static = forwards(shapes=shapes, graphs=False)
            return
        forwards = partial(forwards, graphs=graphs, compiled=compiled)
        self._static = forwards(shapes=shapes)
        if not (chains and shapes.paths > 1):
            return
        self._chains = forwards(shapes=replace(shapes, paths=1))
        if in_place:
            flat = forwards(shapes=replace(shapes, paths=0))
            if same_bits_in_place(self._chains, flat):
                self._in_place = flat
            else:
                self.in_place_differed = True

    def _split_forwards(
        self, forwards, shapes: Shapes, *, graphs: bool, compiled: bool
    ) -> StaticForward:
        """Split attention's forwards: in the Triton kernel where it runs and
        ``kernel_problem`` finds none (``split_kernel_refused`` says otherwise why not), else
        in torch's arithmetic; either ``compiled`` around."""
        arithmetic = partial(forwards, shapes=shapes, split_kernel=False)
        if skinny_matmul.unavailable_reason(self.device) is not None:
            return arithmetic(graphs=graphs, compiled=compiled)
        whole = replace(shapes, spans=shapes.spans[-1:])  # the kernel reads no more than it needs
        try:
            kernel = forwards(shapes=whole, graphs=graphs, compiled=compiled, split_kernel=True)
        except Exception as error:  # capturing its graphs ran it, and it failed
            problem = failure(error)
        else:
            problem = kernel_problem(kernel, arithmetic(graphs=False))
            if problem is None:
                return kernel
        self.split_kernel_refused = problem
        return arithmetic(graphs=graphs, compiled=compiled)

    @property
    def graphs(self) -> int:
        """How many CUDA graphs forwards replay (0: none)."""
        forwards = (self._static, self._chains, self._in_place, self._split)
        return sum(len(s.graphs) for s in forwards if s is not None)

    @property
    def attention(self) -> str:
        """How fixed-width forwards attend: "split" (split_attention.py) or "gathered"."""
        return "split" if self._split is not None else "gathered"

    @property
    def split_kernel(self) -> bool:
        """Whether split attention runs in split_kernel.py's Triton kernel."""
        return self._split is not None and self._split.split_kernel

    @property
    def chains_in_place(self) -> bool:
        """Whether chains in the cache's order attend to it in place (``chain_in_place``, and
        the check at load found the same bits as through the one-path gather)."""
        return self._in_place is not None

    # ------------------------------------------------------------ the model call

    def _evaluate(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        rows: np.ndarray,
        parents: np.ndarray,
        *,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits, last hidden states) of new nodes whose keys/values go to the slots
        after the pending ones (``parents``: as ``forward_tree`` validated them); with
        ``last_only`` the logits of the last node may be all."""
        batches = self._split_plan(positions, parents)
        if batches is not None:
            return self._run_batches(self._split, batches, tokens)
        static = self._static
        if static is not None and static.shapes.paths:
            in_place = self._in_place_batches(positions, parents)
            if in_place is not None:
                return self._run_batches(self._in_place, in_place, tokens)
            return self._run_batches(
                static, self._invariant_batches(static, positions, parents), tokens
            )
        if static is not None and len(tokens) <= static.shapes.widest:
            return self._run_batches(static, self._bucket_batches(static, positions, rows), tokens)
        hidden = self._hidden(tokens, positions, rows)
        return self.model.logits(hidden[-1:] if last_only else hidden), hidden

    def _run_batches(
        self,
        static: StaticForward,
        batches: Iterable[tuple[np.ndarray, Batch]],
        tokens: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run (rows, batch without tokens) pairs; outputs in the nodes' order."""
        logits = torch.empty((len(tokens), self.vocab_size), device=self.device)
        hidden = torch.empty(
            (len(tokens), self.config.hidden_size), dtype=self.dtype, device=self.device
        )
        for chosen, rows in batches:
            out_logits, out_hidden = self._forward_batch(
                static, replace(rows, tokens=tokens[chosen])
            )
            if np.array_equal(chosen, np.arange(len(tokens))):  # no index to send
                logits.copy_(out_logits)
                hidden.copy_(out_hidden)
                continue
            index = torch.from_numpy(chosen)
            if self.device.type == "cuda":  # a copy from pageable memory waits for the GPU
                index = index.pin_memory()
            index = index.to(self.device, non_blocking=True)
            logits.index_copy_(0, index, out_logits)
            hidden.index_copy_(0, index, out_hidden)
        return logits, hidden

    def _forward_batch(
        self, static: StaticForward, batch: Batch, first_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``static.run``, or where the rows lie on one path the one-path shape (each row's
        keys and their order are the same; only the paths beside it, which it never sees, are
        left out), or where that path is the cache's order the cache in place."""
        if self._chains is not None and batch.gather is not None and len(batch.gather) == 1:
            if self._in_place is not None and in_cache_order(batch):
                flat = replace(
                    batch, masks=[mask[0] for mask in batch.masks], gather=None, row_paths=None
                )
                return self._in_place.run(flat, first_token)
            one_path = replace(batch, masks=[mask[:1] for mask in batch.masks])
            return self._chains.run(one_path, first_token)
        return static.run(batch, first_token)

    def _hidden(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """Run new nodes whose keys/values go to the slots after the pending ones."""
        existing = self.pending
        device_positions = torch.from_numpy(positions).to(self.device)
        return self._run_model(
            torch.from_numpy(tokens).to(self.device),
            self._cos[:, device_positions].to(self.dtype),
            self._sin[:, device_positions].to(self.dtype),
            cache_keys=self._keys,
            cache_values=self._values,
            start=self.committed + existing,
            masks=self._attention_masks(rows, positions, existing),
        )

    def _attention_masks(
        self, rows: np.ndarray, positions: np.ndarray, existing: int
    ) -> list[torch.Tensor | None]:
        """One boolean mask (n, keys) per layer: the whole prefix, ancestors in the tree.

        None where every key is visible (a single token continuing a chain), which lets SDPA
        take its unmasked path.
        """
        if rows.all() and set(self.config.sliding_windows) == {None}:
            return [None] * len(self.config.sliding_windows)
        by_window = {
            window: torch.from_numpy(mask).to(self.device)
            for window, mask in self._window_masks(rows, positions, existing).items()
        }
        return [by_window[w] for w in self.config.sliding_windows]

    def _capture_hidden(self, hidden: torch.Tensor) -> None:
        if self.features_sink is not None:
            self._capture(self.model.model.norm(hidden).float().cpu().numpy())

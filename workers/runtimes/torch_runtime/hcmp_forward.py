"""HCMP (Ghidorah's hetero-core model parallelism): one verification forward of the target
computed by two sides at once.

- Every linear layer (and the output head) is split by output columns: the GPU side computes
  the first ``column_split(columns, ratio)`` of them, the CPU side the rest, each writing its
  own columns of the one output (no all-reduce). Layers fed the same input (q/k/v, gate/up)
  form one step: the input crosses to the host once.
- Each head's attention is split at the attention boundary (the committed cache's end, moved
  by ``shift``): the dense part (the queries against the cache before it) on the GPU side, the
  sparse part (against the draft tree's keys from it on, under the tree mask) on the CPU side,
  merged exactly by log-sum-exp (hcmp_attention.py).

The activations, the KV cache and the elementwise work (norms, RoPE, residuals, the merge)
live on the GPU side's device. Where that is CUDA, the GPU side's kernels are queued first and
run while the host computes the CPU side's share (the overlap); the input crosses to the host
once a step and the CPU side's columns come back from pinned memory without a wait. Where
both sides are the CPU, they run one after the other in the calling thread (each with its
own thread count): the split's arithmetic, with no second processor to gain from.

Contract: ``hidden`` and ``logits`` compute what ``CausalLM.forward`` and ``CausalLM.logits``
do for the eager (masked) path, up to float rounding; ``record``, where given, receives the
``Work`` items each side computed (the list ``hcmp_work.forward_work`` predicts).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hetspec.speculative.control.hcmp_work import (
    CPU,
    GPU,
    Work,
    attention_boundary,
    column_split,
)
from hetspec.workers.runtimes.torch_runtime.hcmp_attention import merge, partial_attention
from hetspec.workers.runtimes.torch_runtime.hcmp_sides import HcmpSettings, HcmpSettingsError
from hetspec.workers.runtimes.torch_runtime.model import (
    Attention,
    CausalLM,
    DecoderLayer,
    apply_rope,
)

HOST = torch.device("cpu")


@dataclass(frozen=True)
class ColumnShares:
    """A linear's weight (out, in) cut by output rows: the GPU side's first ``split`` rows (a
    view of the model's weight) and the CPU side's rest (a view too where both sides are the
    CPU, else a host copy)."""

    name: str
    columns: int
    split: int
    gpu_weight: torch.Tensor
    gpu_bias: torch.Tensor | None
    cpu_weight: torch.Tensor
    cpu_bias: torch.Tensor | None

    @classmethod
    def of(
        cls, name: str, weight: torch.Tensor, bias: torch.Tensor | None, ratio: float
    ) -> ColumnShares:
        split = column_split(weight.shape[0], ratio)

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(HOST).contiguous()

        return cls(
            name,
            weight.shape[0],
            split,
            weight[:split],
            None if bias is None else bias[:split],
            host(weight[split:]),
            host(None if bias is None else bias[split:]),
        )


class HcmpForward:
    """The split forward over ``model`` (loaded on the GPU side's device) at ``settings``."""

    def __init__(self, model: CausalLM, settings: HcmpSettings) -> None:
        if model.quantized_head is not None:
            raise HcmpSettingsError("HCMP splits float weights; this model's head is int8")
        self.model = model
        self.settings = settings
        self.home = model.head_weight().device
        self.crosses = self.home.type != "cpu"  # the sides' tensors live on two devices
        ratio = settings.ratio
        self.shares: dict[nn.Module, ColumnShares] = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                parts = name.split(".")  # model.layers.<i>.<block>.<linear>: "<i>.<linear>"
                short = f"{parts[2]}.{parts[-1]}"
                self.shares[module] = ColumnShares.of(short, module.weight, module.bias, ratio)
        self.head = ColumnShares.of("lm_head", model.head_weight(), None, ratio)
        self.dense_side = CPU if ratio == 0.0 else GPU
        self.sparse_side = GPU if ratio == 1.0 else CPU
        self.record: list[Work] | None = None
        self._step = 0

    # ------------------------------------------------------------ the sides

    def _device(self, side: str) -> torch.device:
        return self.home if side == GPU else HOST

    @contextmanager
    def _threads(self, side: str):
        """Compute with ``side``'s thread count where it sets one and both sides are the CPU
        (on CUDA the host computes only the CPU side: its count is the runtime's)."""
        wanted = (self.settings.gpu if side == GPU else self.settings.cpu).threads
        before = torch.get_num_threads()
        if wanted is None or self.crosses or wanted == before:
            yield
            return
        torch.set_num_threads(wanted)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _note(self, side: str, kind: str, name: str, **shape: int) -> None:
        if self.record is not None and shape["columns"]:
            self.record.append(Work(self._step, side, kind, name, **shape))

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(HOST) if self.crosses else x

    def _back(self, part: torch.Tensor, out: torch.Tensor) -> None:
        """Write the CPU side's ``part`` into ``out`` (on the GPU side's device): from pinned
        memory without waiting, where they differ."""
        if self.crosses:
            part = part.pin_memory()
        out.copy_(part, non_blocking=self.crosses)

    # ------------------------------------------------------------ the split operations

    def linears(self, x: torch.Tensor, modules: list[nn.Module]) -> list[torch.Tensor]:
        """One step: each of ``modules`` (linears fed ``x``, (n, in)) by its column shares."""
        return self._split_linears(x, [self.shares[m] for m in modules])

    def _split_linears(self, x: torch.Tensor, shares: list[ColumnShares]) -> list[torch.Tensor]:
        n, inner = x.shape
        outs = [torch.empty(n, s.columns, device=self.home, dtype=x.dtype) for s in shares]
        # the input crosses before the GPU side's kernels are queued: a copy to the host waits
        # for everything queued before it, which would leave nothing to overlap
        host_x = self._to_host(x) if any(s.split < s.columns for s in shares) else None
        with self._threads(GPU):  # queued: on CUDA it runs while the host computes below
            for share, out in zip(shares, outs, strict=True):
                if share.split:
                    out[:, : share.split] = F.linear(x, share.gpu_weight, share.gpu_bias)
                    self._note(GPU, "linear", share.name, rows=n, inner=inner, columns=share.split)
        if host_x is not None:
            with self._threads(CPU):
                for share, out in zip(shares, outs, strict=True):
                    if share.split < share.columns:
                        part = F.linear(host_x, share.cpu_weight, share.cpu_bias)
                        self._back(part, out[:, share.split :])
                        columns = share.columns - share.split
                        self._note(CPU, "linear", share.name, rows=n, inner=inner, columns=columns)
        self._step += 1
        return outs

    def attention(
        self,
        attn: Attention,
        name: str,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        committed: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``Attention.forward``'s eager path (new keys/values to slots start..start+n-1,
        ``mask`` (n, start+n) or None), its linears split by columns and each head split at
        the boundary after ``committed`` cached keys (moved by the settings' shift)."""
        n = x.shape[0]
        q, k, v = self.linears(x, [attn.q_proj, attn.k_proj, attn.v_proj])
        q = q.view(n, attn.heads, attn.head_dim)
        k = k.view(n, attn.kv_heads, attn.head_dim)
        v = v.view(n, attn.kv_heads, attn.head_dim)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = apply_rope(q.transpose(0, 1), cos, sin)
        keys[:, start : start + n] = apply_rope(k.transpose(0, 1), cos, sin)
        values[:, start : start + n] = v.transpose(0, 1)
        span = start + n
        boundary = attention_boundary(committed, self.settings.shift, span)
        scale = attn.scale or attn.head_dim**-0.5
        plan = [
            (self.dense_side, "dense", slice(0, boundary)),
            (self.sparse_side, "sparse", slice(boundary, span)),
        ]
        # each part's inputs on its side's device, the host's copied before any kernel of
        # this step is queued (a copy to the host waits for the queue); then the GPU side's
        # part is queued and the host computes its own meanwhile
        inputs = [
            (
                q.to(self._device(side)),
                keys[:, keep].to(self._device(side)),
                values[:, keep].to(self._device(side)),
                None if mask is None else mask[:, keep].to(self._device(side)),
            )
            for side, _, keep in plan
        ]
        parts = []
        for index in sorted(range(len(plan)), key=lambda i: plan[i][0] != GPU):
            side, kind, keep = plan[index]
            with self._threads(side):
                part = partial_attention(*inputs[index], scale=scale, softcap=attn.softcap)
            parts.append(part.to(self.home))
            self._note(
                side,
                kind,
                name,
                rows=n,
                inner=attn.head_dim,
                columns=keep.stop - keep.start,
                heads=attn.heads,
                kv_heads=attn.kv_heads,
            )
        self._step += 1
        out = merge(*parts).to(x.dtype).transpose(0, 1).reshape(n, attn.heads * attn.head_dim)
        return self.linears(out, [attn.o_proj])[0]

    def mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        mlp = layer.mlp
        gate, up = self.linears(x, [mlp.gate_proj, mlp.up_proj])
        return self.linears(mlp.gate(gate) * up, [mlp.down_proj])[0]

    # ------------------------------------------------------------ the forward

    def hidden(
        self,
        tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cache_keys: torch.Tensor,
        cache_values: torch.Tensor,
        start: int,
        committed: int,
        masks: list[torch.Tensor | None],
    ) -> torch.Tensor:
        """``CausalLM.forward`` (without slots, paths or split attention), split: the last
        layer's output (n, hidden). ``committed``: the cached keys before the draft tree's."""
        self._step = 0
        x = self.model.model.embed(tokens)
        for index, layer in enumerate(self.model.model.layers):
            kind = layer.rope_kind
            normed = layer.input_layernorm(x)
            out = self.attention(
                layer.self_attn,
                f"{index}.attention",
                normed,
                cos[kind],
                sin[kind],
                keys=cache_keys[index],
                values=cache_values[index],
                start=start,
                committed=committed,
                mask=masks[index],
            )
            x = x + (layer.post_attention_layernorm(out) if layer.sandwich else out)
            if layer.sandwich:
                inner = self.mlp(layer, layer.pre_feedforward_layernorm(x))
                x = x + layer.post_feedforward_layernorm(inner)
            else:
                x = x + self.mlp(layer, layer.post_attention_layernorm(x))
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``CausalLM.logits``, the output head split by vocabulary columns."""
        normed = self.model.model.norm(hidden)
        logits = self._split_linears(normed, [self.head])[0].float()
        cap = self.model.config.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

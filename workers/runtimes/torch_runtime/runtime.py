"""TorchRuntime: token-tree forwards over a preallocated KV cache (the GPU worker's engine).

The committed tokens' keys/values fill cache slots 0..committed-1 and the pending tree's nodes
the slots after them, in the order they were evaluated; attention masks make each node see the
prefix and its own ancestors. Committing a path copies its slots right after the prefix.
The tree bookkeeping, appending and drafting come from ``TreeRuntime``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cached_property, partial
from pathlib import Path

import numpy as np
import torch

from hetspec.protocol.sampling import TokenLogprob
from hetspec.protocol.vocab import VocabInfo
from hetspec.speculative.verify.distributions import SamplingParams, distribution
from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.speculative.verify.samplers import ChainDraws, Sampler
from hetspec.speculative.verify.tree import ROOT
from hetspec.workers.runtimes.torch_runtime import skinny_matmul
from hetspec.workers.runtimes.torch_runtime.config import ModelConfig, ModelLoadError
from hetspec.workers.runtimes.torch_runtime.device_choice import DeviceChoice
from hetspec.workers.runtimes.torch_runtime.int8_weights import Int8Linear, use_int8_weights
from hetspec.workers.runtimes.torch_runtime.model import layer_rope_tables
from hetspec.workers.runtimes.torch_runtime.split_attention import path_tails
from hetspec.workers.runtimes.torch_runtime.static_forward import (
    INVARIANT_PATHS,
    Batch,
    Shapes,
    StaticForward,
    failure,
    in_cache_order,
    kernel_problem,
    same_bits_in_place,
)
from hetspec.workers.runtimes.torch_runtime.tokenizer import FolderTokenizer
from hetspec.workers.runtimes.torch_runtime.weights import load_model
from hetspec.workers.runtimes.tree_runtime import TreeRuntime

DEFAULT_MAX_CONTEXT = 8192  # the KV cache for a 128k-context model would not fit most boxes
# A CUDA verifier's rows per forward (``fixed_width``): the widest tree most rounds verify; a
# wider one takes several forwards. On a GPU a forward of 16 rows costs about one of 1.
DEFAULT_FIXED_WIDTH = 16


@dataclass(frozen=True)
class TreeOutput:
    logits: torch.Tensor  # (nodes, vocab) float32, on the runtime's device
    hidden: torch.Tensor  # (nodes, hidden) last decoder layer output, before the final norm


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {requested!r} requested but CUDA is not available")
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if requested not in dtypes:
        raise ModelLoadError(f"dtype {requested!r} is not one of auto, {', '.join(dtypes)}")
    return dtypes[requested]


def span_runs(
    shapes: Shapes, positions: np.ndarray, most_rows: int | None = None
) -> Iterator[tuple[np.ndarray, int]]:
    """Rows at ``positions`` in order, in runs of at most ``most_rows`` (None: the widest
    shape) that share a span bucket (their own positions'): (rows, span) each."""
    spans = np.asarray(shapes.spans)
    row_spans = spans[np.searchsorted(spans, positions + 1)]
    most_rows = most_rows or shapes.widest
    begin = 0
    while begin < len(positions):
        end = min(begin + most_rows, len(positions))
        end = begin + int(np.argmax(np.append(row_spans[begin:end], -1) != row_spans[begin]))
        yield np.arange(begin, end), int(row_spans[begin])
        begin = end


class TorchRuntime(TreeRuntime[TreeOutput]):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_context: int | None = None,
        threads: int | None = None,
        compile: bool = False,
        cuda_graphs: bool = True,
        fixed_width: int | None = None,
        span_buckets: bool = True,
        verifies: bool = False,
        invariant_paths: int = INVARIANT_PATHS,
        chain_forwards: bool = True,
        chain_in_place: bool = True,
        attention: str = "gathered",
        matmul: str = "torch",
        matmul_tiling: dict[str, int] | None = None,
        weights: str = "dtype",
    ) -> None:
        """Load ``model_dir``.

        On CUDA every forward runs in a fixed shape (static_forward.py), replayed as a CUDA
        graph unless ``cuda_graphs`` is False. ``fixed_width`` > 0 makes every forward that
        many rows (wider calls take several), so a token's logits do not depend on what it is
        evaluated with; None: ``DEFAULT_FIXED_WIDTH`` for a verifier (``verifies``) on CUDA,
        else 0 (width buckets 1, 2, 4 .. 64). On the CPU forwards run in the call's own shape
        unless ``fixed_width`` > 0. ``span_buckets`` False attends over the whole context in
        every forward instead of the narrowest power of two that holds it. A fixed-width
        forward gathers ``invariant_paths`` tree paths (a tree of more takes several);
        with ``chain_forwards`` a forward whose rows lie on one path runs in a shape of its
        own that gathers one (a chain attends over a quarter of the keys), and with
        ``chain_in_place`` one whose path is the cache's own order (the target alone, a
        chain's verification) attends to the cache in place, with no gather, where a check
        at load finds its bits the one-path shape's (``chains_in_place``).
        ``attention`` "split": fixed-width forwards attend as split_attention.py does instead
        (any tree in one forward, each row's bits those it gets on its own, by construction);
        a call with a row too deep below where its path leaves the cache's order for that runs
        in eager gathered forwards (``deep_rows`` counts them).
        ``compile`` runs the model through torch.compile: each fixed shape's forward (compiled
        at load with the graphs on CUDA), or where shapes vary each new shape's first forward.
        ``matmul`` "triton": linear layers of at most 16 rows in ``skinny_matmul`` (a GPU, or
        Triton's interpreter), cut as ``skinny_matmul.Tiling`` with ``matmul_tiling``'s
        fields changed (with ``compile``, one opaque op each that inductor fuses around).
        ``weights`` "int8": every linear layer's weight (and the output head's) in int8 with
        a float32 scale per output row, read by that kernel whatever ``matmul`` says
        (int8_weights.py: the int8 model's text, not the original's)."""
        folder = Path(model_dir)
        if not folder.is_dir():
            raise ModelLoadError(f"{folder}: not a directory")
        if threads is not None:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.config = self._read_config(folder)
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        limit = self.config.max_context
        capacity = max_context or min(limit, DEFAULT_MAX_CONTEXT)
        if not 0 < capacity <= limit:
            raise ModelLoadError(
                f"{folder}: context {capacity} is outside what the model allows (1..{limit})"
            )
        self.model = self._load_model(folder)
        self.weights = self._use_matmul(matmul, matmul_tiling, weights)
        self._run_model = torch.compile(self.model, dynamic=True) if compile else self.model
        if fixed_width is None:
            fixed_width = DEFAULT_FIXED_WIDTH if verifies and self.device.type == "cuda" else 0
        if fixed_width < 0:
            raise ModelLoadError(f"fixed_width {fixed_width} is negative")
        self.fixed_width = fixed_width
        static = self.static_shapes and (self.device.type == "cuda" or fixed_width > 0)
        if attention not in ("gathered", "split"):
            raise ModelLoadError(f'attention must be "gathered" or "split", not {attention!r}')
        try:
            shapes = Shapes.for_context(
                capacity,
                fixed_width=fixed_width,
                span_buckets=span_buckets,
                paths=invariant_paths,
            )
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
        split = attention == "split" and static and shapes.paths > 0
        scratch = shapes.widest if static else 0  # slots for padding rows' keys/values
        c = self.config
        shape = (c.num_layers, c.num_kv_heads, capacity + scratch, c.head_dim)
        self._keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._cos, self._sin = layer_rope_tables(c, capacity, self.device)
        self.folder = folder
        super().__init__(c.vocab_size, capacity)
        self.feature_size = c.hidden_size
        self._pinned: np.ndarray | None = None  # host memory registered with CUDA
        self._static: StaticForward | None = None
        self._chains: StaticForward | None = None  # one-path forwards, beside _static
        self._in_place: StaticForward | None = None  # one path in cache order, no gather
        self.in_place_differed = False  # chain_in_place, refused: its bits were not the gather's
        # split attention's forwards, the rows it sent to the gathered ones, and why its
        # Triton kernel does not serve (None: it does, or was never tried)
        self._split, self.deep_rows, self.split_kernel_refused = None, 0, None
        if static:
            self._build_forwards(
                shapes,
                capacity,
                graphs=cuda_graphs,
                compiled=compile,
                chains=chain_forwards,
                in_place=chain_in_place,
                split=split,
            )
        else:
            self._run_chain = None  # eager forwards: each step's is the host's anyway

    _split: StaticForward | None
    split_kernel_refused: str | None
    static_shapes = True  # a subclass with another model call turns fixed shapes off
    outputs_kept = True  # a forward's logits are its own tensor (static outputs are copied)

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

    def _use_matmul(self, matmul: str, tiling: dict[str, int] | None, weights: str) -> str:
        """Put the Triton kernel under the linear layers where ``matmul`` or ``weights``
        ask for it; returns the weights' format."""
        if matmul not in ("torch", "triton"):
            raise ModelLoadError(f'matmul must be "torch" or "triton", not {matmul!r}')
        if weights not in ("dtype", "int8"):
            raise ModelLoadError(f'weights must be "dtype" or "int8", not {weights!r}')
        if matmul == "torch" and weights == "dtype":
            if tiling:
                raise ModelLoadError(
                    'matmul_tiling cuts the Triton matmul: it needs matmul "triton"'
                )
            return weights
        asked = (
            'weights "int8" (read by the Triton matmul)' if weights == "int8" else 'matmul "triton"'
        )
        reason = skinny_matmul.unavailable_reason(self.device)
        if reason is not None:
            raise ModelLoadError(f"{asked} cannot run here: {reason}")
        try:
            cut = replace(skinny_matmul.DEFAULT_TILING, **(tiling or {}))
        except (TypeError, ValueError) as error:
            raise ModelLoadError(f"matmul_tiling: {error}") from None
        if weights == "int8":  # no fallback would be faster: a kernel that cannot serve fails
            use_int8_weights(self.model, cut)
            head = self.model.quantized_head
            first = next(m for m in self.model.modules() if isinstance(m, Int8Linear))
            problem = self._matmul_problem(
                cut, (first.weight, first.scale), (head.weight, head.scale)
            )
            if problem is not None:
                raise ModelLoadError(f"{asked}: the kernel cannot serve them here: {problem}")
            return weights
        first = next(m.weight for m in self.model.modules() if isinstance(m, torch.nn.Linear))
        problem = self._matmul_problem(cut, (first, None), (self.model.head_weight(), None))
        if problem is not None:  # slower, never wrong: cuBLAS, and the device line says why
            self.matmul_refused = problem
            return weights
        skinny_matmul.use_skinny_linears(self.model, cut)
        self.model.head_linear = partial(skinny_matmul.linear, tiling=cut)
        return weights

    matmul_refused: str | None = None  # why matmul "triton" fell back to torch's (None: it did not)

    def _matmul_problem(self, tiling: skinny_matmul.Tiling, *weights) -> str | None:
        """Why the Triton kernel cannot serve the (weight, int8 scale or None) pairs given
        (the first layer's and the output head's); None: it serves."""
        for weight, scale in weights:
            problem = skinny_matmul.kernel_problem(weight, self.dtype, scale=scale, tiling=tiling)
            if problem is not None:
                return problem
        return None

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

    def _read_config(self, folder: Path) -> ModelConfig:
        """The shape the KV cache and RoPE tables are built for."""
        return ModelConfig.from_folder(folder)

    def _load_model(self, folder: Path):
        return load_model(folder, self.config, self.dtype, self.device)

    def set_extra_threads(self, extra: int) -> None:
        """Compute with ``extra`` threads beyond the configured ones (on cores lent for now:
        see workers/runtimes/spare_cores.py); 0 restores the configured count."""
        torch.set_num_threads(self.threads + extra)

    # ------------------------------------------------------------ vocabulary

    @cached_property
    def tokenizer(self) -> FolderTokenizer:
        """The folder's ``tokenizer.json`` (read on first use: tests build folders without one)."""
        return FolderTokenizer(self.folder, self.config.vocab_size)

    def vocab_info(self) -> VocabInfo:
        return self.tokenizer.vocab_info()

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special)

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.token_bytes(token)

    def special_tokens(self) -> list[int]:
        """The tokenizer's special added tokens: markup, not text."""
        return sorted(t for t in self.tokenizer.specials if t < self.vocab_size)

    # ------------------------------------------------------------ TreeRuntime hooks

    @torch.inference_mode()
    def _run(
        self, tokens: np.ndarray, parents: np.ndarray, positions: np.ndarray, rows: np.ndarray
    ) -> TreeOutput:
        logits, hidden = self._evaluate(tokens, positions, rows, parents)
        self._capture_hidden(hidden)
        return TreeOutput(logits, hidden)

    def _capture_hidden(self, hidden: torch.Tensor) -> None:
        if self.features_sink is not None:
            self._capture(self.model.model.norm(hidden).float().cpu().numpy())

    def _node_logits(self, output: TreeOutput, index: int) -> np.ndarray:
        return output.logits[index].cpu().numpy()

    def _step_logits(self, output: TreeOutput) -> np.ndarray:
        return output.logits.cpu().numpy()

    def _step_argmax(self, output: TreeOutput) -> np.ndarray:
        return output.logits.argmax(dim=-1).cpu().numpy()  # a few bytes leave the device

    def _write_step_logits(self, output: TreeOutput, out: np.ndarray) -> None:
        torch.from_numpy(out).copy_(output.logits)  # one copy: device to ``out`` itself

    def pin_host_memory(self, memory: np.ndarray) -> bool:
        """On CUDA, page-lock ``memory`` (cudaHostRegister) so logits copied into it go by
        DMA, not through the driver's staging buffer; False where not on CUDA or refused."""
        if self.device.type != "cuda" or self._pinned is not None:
            return False
        status = torch.cuda.cudart().cudaHostRegister(memory.ctypes.data, memory.nbytes, 0)
        if int(status) != 0:  # cudaSuccess
            return False
        self._pinned = memory
        return True

    def close(self) -> None:
        """Release what ``pin_host_memory`` took (before that memory is unmapped)."""
        if self._pinned is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned.ctypes.data)
            self._pinned = None

    @torch.inference_mode()
    def _keep_path(self, path: list[int]) -> None:
        start, count = self.committed, len(path)
        if path != list(range(count)):  # move the path's slots right after the prefix
            source = torch.tensor(path, device=self.device) + start
            self._keys[:, :, start : start + count] = self._keys[:, :, source]
            self._values[:, :, start : start + count] = self._values[:, :, source]

    def _drop_pending_kv(self) -> None:
        """Nothing to do: pending slots are overwritten by the next forward."""

    def _truncate_kv(self, length: int) -> None:
        """Nothing to do: slots past the committed length are never attended to."""

    @torch.inference_mode()
    def _extend_committed(self, tokens: np.ndarray) -> np.ndarray:
        count = len(tokens)
        rows = np.tril(np.ones((count, count), bool))
        positions = self.committed + np.arange(count)
        chain = np.arange(-1, count - 1)
        logits, hidden = self._evaluate(tokens, positions, rows, chain, last_only=True)
        self._capture_hidden(hidden)
        return logits[-1].cpu().numpy()

    # ------------------------------------------------------------ chains on the device

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
    ) -> list[int]:
        """``TreeRuntime.decode``; in fixed shapes the forwards run back to back on the
        device, each next token chosen there (the same bits: each forward is the one
        ``TreeRuntime.decode`` would run), and the host waits once. Greedy: the argmax.
        Sampled at a temperature alone: as the sampler's ``ChainDraws`` say, each choice
        guarded (``DeviceChoice.safe``): from the first one the host might have made
        otherwise, the host chooses and decoding goes on from there, so the tokens are the
        host loop's. Truncating samplers (top-k, top-p) decode in the host's loop."""
        truncates = 0 < params.top_k < self.vocab_size or params.top_p < 1
        if steps < 2 or self._static is None or (not params.greedy and truncates):
            return super().decode(steps, params, sampler, logprobs=logprobs, top=top)
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

    def _split_plan(
        self, positions: np.ndarray, parents: np.ndarray, most_rows: int | None = None
    ) -> Iterator[tuple[np.ndarray, Batch]] | None:
        """Split attention's forwards of new nodes after the pending ones (``_split_batches``);
        None without split attention or where a row is too deep for it."""
        if self._split is None:
            return None
        tails = self._split_tails(positions, parents)
        if tails is None:
            return None
        return self._split_batches(self._split, positions, tails, most_rows)

    def _split_tails(self, positions: np.ndarray, parents: np.ndarray) -> np.ndarray | None:
        """``path_tails`` of new nodes after the pending ones (None, counted in
        ``deep_rows``: a row too deep for split attention)."""
        existing = self.pending
        tails = path_tails(
            self.committed,
            np.concatenate([self._pending_parents[:existing], parents]),
            np.concatenate([self._pending_depths[:existing], positions - self.committed]),
            existing + np.arange(len(positions)),
            self._split.shapes.tail_block,
        )
        if tails is None:
            self.deep_rows += len(positions)
        return tails

    def _split_batches(
        self,
        split: StaticForward,
        positions: np.ndarray,
        tails: np.ndarray,
        most_rows: int | None = None,
    ) -> Iterator[tuple[np.ndarray, Batch]]:
        """Split attention's forwards: rows in order, at most ``widest`` (or ``most_rows``)
        a forward, all of one span bucket (their own positions')."""
        first = self.committed + self.pending
        for rows, span in span_runs(split.shapes, positions, most_rows):
            yield (
                rows,
                Batch(
                    tokens=np.empty(0, np.int64),
                    positions=positions[rows],
                    slots=first + rows,
                    masks=[],
                    span=span,
                    tail_slots=tails[rows],
                ),
            )

    def _in_place_batches(
        self, positions: np.ndarray, parents: np.ndarray, most_rows: int | None = None
    ) -> Iterator[tuple[np.ndarray, Batch]] | None:
        """The in-place forwards of new nodes that extend a chain in the cache's order (the
        target alone, a chain verified after the committed tokens): the batches
        ``_forward_batch`` makes of ``_invariant_batches``' one-path ones, without building
        the gathers and path masks it would drop. None where chains do not attend in place
        or the nodes and the pending ones are not one chain from the committed end."""
        flat, existing, count = self._in_place, self.pending, len(positions)
        if flat is None or not (
            np.array_equal(parents, np.arange(existing - 1, existing + count - 1))
            and np.array_equal(self._pending_parents[:existing], np.arange(-1, existing - 1))
        ):
            return None
        return self._chain_batches(flat, positions, most_rows)

    def _chain_batches(
        self, flat: StaticForward, positions: np.ndarray, most_rows: int | None
    ) -> Iterator[tuple[np.ndarray, Batch]]:
        """``_in_place_batches``' forwards (``span_runs``), each row seeing the slots up to
        its own (within each sliding window)."""
        first = self.committed + self.pending
        for rows, span in span_runs(flat.shapes, positions, most_rows):
            picked, keys = positions[rows, None], np.arange(span)
            seen = keys <= picked
            masks = [
                seen if window is None else seen & (keys > picked - window)
                for window in flat.windows
            ]
            yield (
                rows,
                Batch(
                    tokens=np.empty(0, np.int64),
                    positions=positions[rows],
                    slots=first + rows,
                    masks=masks,
                    span=span,
                ),
            )

    def _bucket_batches(
        self, static: StaticForward, positions: np.ndarray, rows: np.ndarray
    ) -> list[tuple[np.ndarray, Batch]]:
        """One forward in cache order (masks over slots), the narrowest buckets that fit."""
        first = self.committed + self.pending  # the first new node's cache slot
        count = len(positions)
        by_window = self._window_masks(rows, positions, self.pending)
        batch = Batch(
            tokens=np.empty(0, np.int64),
            positions=positions,
            slots=np.arange(first, first + count),
            masks=[by_window[w] for w in static.windows],
            span=static.shapes.span_for(first + count),
        )
        return [(np.arange(count), batch)]

    def _invariant_batches(
        self,
        static: StaticForward,
        positions: np.ndarray,
        parents: np.ndarray,
        most_rows: int | None = None,
    ) -> Iterator[tuple[np.ndarray, Batch]]:
        """Width-invariant forwards (static_forward.py): rows in order, a forward holding at
        most ``widest`` (or ``most_rows``) rows of one span bucket (their own positions') on
        at most ``shapes.paths`` root-to-node paths, each row attending to its path in
        position order. Each forward is made as it is asked for, so a caller may run one
        while the next is made."""
        shapes, committed, existing = static.shapes, self.committed, self.pending
        tree = np.concatenate([self._pending_parents[:existing], parents]).tolist()  # pending + new
        node_positions = np.concatenate(  # of every pending node, existing ones first
            [committed + self._pending_depths[:existing], positions]
        ).tolist()
        spans = np.asarray(shapes.spans)
        row_spans = spans[np.searchsorted(spans, np.asarray(positions) + 1)].tolist()
        most_rows = most_rows or shapes.widest
        chosen: list[int] = []
        leaves: list[int] = []  # each path's deepest node so far (index into ``tree``)
        row_paths: list[int] = []

        def flush() -> tuple[np.ndarray, Batch]:
            span, count = row_spans[chosen[0]], len(chosen)
            gather = np.zeros((len(leaves), span), np.int64)
            gather[:, :committed] = np.arange(committed)
            for path, leaf in enumerate(leaves):
                node = leaf
                while node >= 0:  # slot of each ancestor at its position
                    gather[path, node_positions[node]] = committed + node
                    node = tree[node]
            rows = np.array(chosen)
            picked = positions[rows]
            keys = np.arange(span)
            seen = keys <= picked[:, None]
            on_path = (np.array(row_paths), np.arange(count))
            masks = []
            for window in static.windows:
                mask = np.zeros((shapes.paths, count, span), bool)
                mask[:, :, 0] = True  # a row sees slot 0 only through paths not its own
                mask[on_path] = seen if window is None else seen & (keys > picked[:, None] - window)
                masks.append(mask)
            batch = Batch(
                tokens=np.empty(0, np.int64),
                positions=picked,
                slots=committed + existing + rows,
                masks=masks,
                span=span,
                gather=gather,
                row_paths=on_path[0],
            )
            chosen.clear(), leaves.clear(), row_paths.clear()
            return rows, batch

        for row, span in enumerate(row_spans):
            node = existing + row
            parent = tree[node]
            extends = parent in leaves
            if chosen and (
                row_spans[chosen[0]] != span
                or len(chosen) == most_rows
                or (not extends and len(leaves) == shapes.paths)
            ):
                yield flush()
                extends = False
            if extends:
                path = leaves.index(parent)
                leaves[path] = node
            else:
                path = len(leaves)
                leaves.append(node)
            chosen.append(row)
            row_paths.append(path)
        yield flush()

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

    def _window_masks(
        self, rows: np.ndarray, positions: np.ndarray, existing: int
    ) -> dict[int | None, np.ndarray]:
        """Per distinct sliding window (None: none), which of the committed + pending + new
        cache slots each new node sees, (n, keys)."""
        n, prefix = len(rows), self.committed
        allowed = np.ones((n, prefix + rows.shape[1]), bool)
        allowed[:, prefix:] = rows
        key_positions = np.concatenate(
            [np.arange(prefix), prefix + self._pending_depths[:existing], positions]
        )
        by_window = {}
        for window in set(self.config.sliding_windows):
            mask = allowed
            if window is not None:  # keys no more than window-1 positions back
                mask = allowed & (key_positions[None, :] > positions[:, None] - window)
            by_window[window] = mask
        return by_window

"""TorchRuntime: token-tree forwards over a preallocated KV cache (the GPU worker's engine).

The committed tokens' keys/values fill cache slots 0..committed-1 and the pending tree's nodes
the slots after them, in the order they were evaluated; attention masks make each node see the
prefix and its own ancestors. Committing a path copies its slots right after the prefix.
The tree bookkeeping, appending and drafting come from ``TreeRuntime``.

``TorchRuntime`` stacks one concern a module on ``TreeRuntime``:

- ``forward_plans.ForwardPlans``: which rows each forward runs and which slots each row sees;
- ``torch_forwards.TorchForwards``: the forwards built at load and the model call that runs
  those plans (``TreeOutput``);
- ``device_chains.DeviceChains``: a chain's forwards queued on the device, each next token
  chosen there (drafting a chain, the target alone);
- here: loading (the settings of device_settings.py, the cache, the forwards), the
  vocabulary, and the hooks ``TreeRuntime`` calls.

``TreeOutput``, ``DEFAULT_MAX_CONTEXT``, ``pick_device`` and ``pick_dtype`` are importable from
here, as before the split.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from hetspec.protocol.vocab import VocabInfo
from hetspec.workers.runtimes.torch_runtime.config import ModelConfig, ModelLoadError
from hetspec.workers.runtimes.torch_runtime.device_chains import DeviceChains
from hetspec.workers.runtimes.torch_runtime.device_settings import (
    DEFAULT_FIXED_WIDTH,
    DEFAULT_MAX_CONTEXT,
    pick_device,
    pick_dtype,
    use_matmul,
)
from hetspec.workers.runtimes.torch_runtime.model import layer_rope_tables
from hetspec.workers.runtimes.torch_runtime.static_forward import (
    INVARIANT_PATHS,
    Shapes,
    StaticForward,
)
from hetspec.workers.runtimes.torch_runtime.tokenizer import FolderTokenizer
from hetspec.workers.runtimes.torch_runtime.torch_forwards import TreeOutput
from hetspec.workers.runtimes.torch_runtime.weights import load_model

__all__ = ["DEFAULT_MAX_CONTEXT", "TorchRuntime", "TreeOutput", "pick_device", "pick_dtype"]


class TorchRuntime(DeviceChains):
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
        self.weights, self.matmul_refused = use_matmul(
            self.model,
            self.device,
            self.dtype,
            matmul=matmul,
            tiling=matmul_tiling,
            weights=weights,
        )
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

    static_shapes = True  # a subclass with another model call turns fixed shapes off
    outputs_kept = True  # a forward's logits are its own tensor (static outputs are copied)
    matmul_refused: str | None = None  # why matmul "triton" fell back to torch's (None: it did not)

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

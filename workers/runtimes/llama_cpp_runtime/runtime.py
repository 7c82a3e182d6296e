"""LlamaCppRuntime: token trees and batched branches on llama.cpp's sequence machinery.

llama.cpp has no custom attention mask; a cell of its KV cache is visible to a query when they
share a sequence id and the cell's position is not after the query's. So the committed prefix is
sequence 0, every leaf of the pending tree owns a sequence forked from the prefix (a metadata
copy in the unified cache), and each node carries the ids of all leaves below it: it then sees
the prefix and exactly its ancestors. Committing a path copies its cells into sequence 0 and
keeps only sequence 0; nothing is recomputed and no state is saved or restored.
"""

from __future__ import annotations

import copy
import ctypes
import os
from pathlib import Path

import llama_cpp as L
import numpy as np
import structlog

from hetspec.protocol.gguf_checks import GGUFMetadataError, check_model_file
from hetspec.protocol.gguf_header import GGUFFormatError
from hetspec.speculative.drafting.vocab_match import VocabInfo
from hetspec.speculative.verify.tree import ROOT
from hetspec.workers.runtimes.llama_cpp_runtime.ggml import local_gpu_present, local_gpus
from hetspec.workers.runtimes.llama_cpp_runtime.log import llama_log
from hetspec.workers.runtimes.llama_cpp_runtime.rpc import RpcError
from hetspec.workers.runtimes.llama_cpp_runtime.rpc import add_servers as add_rpc_servers
from hetspec.workers.runtimes.llama_cpp_runtime.vocabulary import Vocabulary
from hetspec.workers.runtimes.tree_runtime import RuntimeUsageError, TreeRuntime

DEFAULT_MAX_CONTEXT = 8192
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
PREFIX_SEQ = 0
FLASH_ATTENTION = {
    "auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
GGUF_MAGIC = b"GGUF"
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml type ids; a quantized V needs flash attention


def _cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def batch_invariant() -> bool:
    """Whether this llama.cpp gives a token's logits whatever else its forward evaluates.
    Built with llamafile's sgemm it does not (its tiles sum quantized rows another way once a
    forward holds several tokens), and a verifier's greedy output then leaves the target's
    own at near-ties; native/llama-cmake-args.sh builds it without."""
    return b"LLAMAFILE = 1" not in L.llama_print_system_info()


class LlamaCppError(RuntimeError):
    """llama.cpp refused a model, a context or a batch; carries what llama.cpp logged."""


class LlamaCppRuntime(TreeRuntime[np.ndarray]):
    _owns_model = True  # False in a sibling: the runtime it came from frees the model

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int | None = None,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        threads: int | None = None,
        threads_batch: int | None = None,
        n_seq_max: int = 16,
        mmap: bool = True,
        flash_attention: str = "auto",
        kv_type: str = "f16",
        v_type: str | None = None,
        gpu_layers: int = 0,
        rpc_servers: tuple[str, ...] | list[str] = (),
        sequences: int = 1,
    ) -> None:
        """Load a GGUF file. ``n_seq_max`` - 1 is the most leaves a pending tree may have;
        threads default to the cores this process may run on and may not exceed them. With
        ``rpc_servers`` (HOST:PORT of llama.cpp rpc-servers), the last ``gpu_layers`` layers
        (-1: all, and the output layer) run on those hosts, split by their free memory.
        ``sequences`` > 1: ``siblings`` are that many less one runtimes of the same loaded
        model, each a context (and KV cache) of its own, closed with this one."""
        path = Path(model_path)
        self.path = path
        owned = len(os.sched_getaffinity(0))
        threads = threads or owned
        threads_batch = threads_batch or threads
        if max(threads, threads_batch) > owned:
            raise LlamaCppError(
                f"{max(threads, threads_batch)} threads requested but this process owns {owned} "
                "cores; more threads than cores only slows llama.cpp down"
            )
        v_type = v_type or kv_type
        self._check_options(flash_attention, kv_type, v_type, n_seq_max, sequences)
        self._check_file(path)
        self._log = llama_log()
        L.llama_backend_init()
        if not batch_invariant():
            structlog.get_logger("hetspec.worker").warning(
                "llama.cpp was built with llamafile's sgemm: its logits depend on how many "
                "tokens a forward holds, so verifying with it can leave the target's own "
                "greedy output at near-ties; make setup rebuilds it without"
            )

        self._model = self._load_model(path, mmap, gpu_layers, tuple(rpc_servers))
        trained = L.llama_model_n_ctx_train(self._model)
        n_ctx = n_ctx or min(trained, DEFAULT_MAX_CONTEXT)
        if not 0 < n_ctx <= trained:
            self.close()
            raise LlamaCppError(
                f"{path}: context {n_ctx} is outside what the model allows (1..{trained})"
            )
        n_batch = min(n_batch, n_ctx)
        context_params = L.llama_context_default_params()
        context_params.n_ctx = n_ctx
        context_params.n_batch = n_batch
        context_params.n_ubatch = min(n_ubatch or n_batch, n_batch)
        context_params.n_seq_max = n_seq_max
        # llama.cpp reserves an output row per sequence at creation and aborts the process
        # (GGML_ASSERT) when that exceeds n_outputs_max, which defaults to n_batch.
        context_params.n_outputs_max = max(n_batch, n_seq_max)
        context_params.n_threads = threads
        context_params.n_threads_batch = threads_batch
        context_params.flash_attn_type = FLASH_ATTENTION[self._flash_attention(flash_attention)]
        context_params.type_k, context_params.type_v = KV_TYPES[kv_type], KV_TYPES[v_type]
        context_params.kv_unified = True  # tree nodes carry several sequence ids
        context_params.no_perf = True
        self._context_params = context_params
        self.n_batch, self.n_seq_max = n_batch, n_seq_max
        self.max_leaves = n_seq_max - 1
        self.default_chunk = n_batch
        self.threads, self.threads_batch = threads, threads_batch
        self._vocabulary = Vocabulary(self._model)
        self.feature_size = L.llama_model_n_embd(self._model)
        try:
            self._open_context(n_ctx)
            self.siblings = [self._sibling() for _ in range(sequences - 1)]
        except LlamaCppError:
            self.close()
            raise

    def _open_context(self, n_ctx: int) -> None:
        """A context of this runtime's settings on its model, and an empty sequence in it."""
        mark = self._log.count
        self._context = L.llama_init_from_model(self._model, self._context_params)
        if not self._context:
            raise self._error(f"{self.path}: llama.cpp could not create a context", mark)
        self._memory = L.llama_get_memory(self._context)
        self._batch = L.llama_batch_init(self.n_batch, 0, self.n_seq_max)
        super().__init__(self._vocabulary.size, n_ctx)
        self._embeddings = False  # llama.cpp's per-token output of the final norm: features

    def _sibling(self) -> LlamaCppRuntime:
        """Another sequence on this runtime's model: a shallow copy (the model, vocabulary
        and settings shared) given a context, batch and sequence state of its own."""
        sibling = copy.copy(self)
        sibling._context = sibling._batch = None
        sibling.siblings, sibling._owns_model = [], False
        sibling._open_context(self.capacity)
        return sibling

    # ------------------------------------------------------------ setup helpers

    def _flash_attention(self, setting: str) -> str:
        """llama.cpp's "auto" turns flash attention on for the CPU too, where it slows steps
        and batches down (docs/design-notes.md, "llama.cpp's settings"); so "auto" means
        "off" unless layers are on a GPU of this machine (rpc-servers compute on their CPUs,
        as a rule)."""
        return "off" if setting == "auto" and not self._on_local_gpu else setting

    def _load_model(
        self, path: Path, mmap: bool, gpu_layers: int, rpc_servers: tuple[str, ...]
    ) -> L.llama_model_p:
        params = L.llama_model_default_params()
        # 0 for the CPU worker (the GPU belongs to the torch worker); a llama.cpp GPU worker
        # offloads what it is told (-1: every layer), which a CPU-only build ignores
        params.n_gpu_layers = gpu_layers if gpu_layers >= 0 else 2**31 - 1
        # where the layers run: offloading needs a GPU build of llama.cpp and a GPU, or
        # rpc-servers
        self._on_local_gpu = gpu_layers != 0 and local_gpu_present()
        devices = []
        if rpc_servers:
            try:
                devices = add_rpc_servers(rpc_servers)
            except RpcError as error:
                raise LlamaCppError(f"{path}: {error}") from None
        # exactly these servers, then this box's GPUs, as llama.cpp orders them; never all
        # registered devices (its default), which would take in an rpc-server another load in
        # this process registered (one that has gone aborts the process). The NULL-terminated
        # list must live until the load returns.
        devices += local_gpus() if self._on_local_gpu else []
        self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
        params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        self.offloaded = self._on_local_gpu or (gpu_layers != 0 and bool(rpc_servers))
        params.load_mode = L.LLAMA_LOAD_MODE_MMAP if mmap else L.LLAMA_LOAD_MODE_NONE
        # llama.cpp's extra buffer types repack weights for the CPU's SIMD; on CPUs with AMX
        # the AMX buffer of llama-cpp-python 0.3.36 segfaults on Q8_0 models (seen on a
        # Sapphire Rapids VM), so plain buffers there
        params.use_extra_bufts = not _cpu_has_amx()
        mark = self._log.count
        model = L.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise self._error(f"{path}: llama.cpp could not load this model", mark)
        return model

    @staticmethod
    def _check_options(
        flash_attention: str, kv_type: str, v_type: str, n_seq_max: int, sequences: int
    ) -> None:
        if flash_attention not in FLASH_ATTENTION:
            raise LlamaCppError(f"flash_attention must be one of {', '.join(FLASH_ATTENTION)}")
        for name, value in (("kv_type", kv_type), ("v_type", v_type)):
            if value not in KV_TYPES:
                raise LlamaCppError(f"{name} must be one of {', '.join(KV_TYPES)}, not {value!r}")
        if not 2 <= n_seq_max <= MAX_SEQUENCES:
            raise LlamaCppError(f"n_seq_max must be in 2..{MAX_SEQUENCES}, not {n_seq_max}")
        if sequences < 1:
            raise LlamaCppError(f"cannot serve {sequences} sequences")

    @staticmethod
    def _check_file(path: Path) -> None:
        try:
            with path.open("rb") as handle:
                magic = handle.read(4)
        except FileNotFoundError:
            raise LlamaCppError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise LlamaCppError(f"{path}: a directory, not a GGUF file") from None
        except OSError as error:
            raise LlamaCppError(f"{path}: cannot read: {error.strerror}") from None
        if magic != GGUF_MAGIC:
            raise LlamaCppError(f"{path}: not a GGUF file (starts with {magic!r})")
        try:  # metadata that contradicts the tensors: llama.cpp may allocate by it, or abort
            check_model_file(path)
        except GGUFMetadataError as error:
            raise LlamaCppError(str(error)) from None
        except (GGUFFormatError, OSError):
            pass  # a header llama.cpp refuses too, in its own words

    def _error(self, message: str, mark: int) -> LlamaCppError:
        said = self._log.since(mark)
        detail = ("; llama.cpp said: " + " | ".join(said[-4:])) if said else ""
        return LlamaCppError(message + detail)

    def close(self) -> None:
        """Free the siblings' contexts, then this one's context, batch and model (also done
        when the object is collected); a sibling frees its own context and batch only."""
        for sibling in getattr(self, "siblings", ()):
            sibling.close()
        self.siblings = []
        if getattr(self, "_batch", None) is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_context", None):
            L.llama_free(self._context)
            self._context = None
        if getattr(self, "_model", None) and self._owns_model:
            L.llama_model_free(self._model)
        self._model = None

    def __del__(self) -> None:
        self.close()

    def set_extra_threads(self, extra: int) -> None:
        """Compute with ``extra`` threads beyond the configured ones (on cores lent for now:
        see workers/runtimes/spare_cores.py); 0 restores the configured counts."""
        L.llama_set_n_threads(self._context, self.threads + extra, self.threads_batch + extra)

    # ------------------------------------------------------------ vocabulary

    def vocab_info(self) -> VocabInfo:
        return self._vocabulary.info()

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; special-token markup (``<|im_start|>``) is parsed."""
        return self._vocabulary.tokenize(text, add_special=add_special)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (specials rendered), for incremental detokenizing."""
        return self._vocabulary.token_bytes(token)

    def special_tokens(self) -> list[int]:
        return self._vocabulary.special_tokens()

    # ------------------------------------------------------------ decoding

    def _decode(
        self, tokens: np.ndarray, positions: np.ndarray, seqs: list[list[int]], logits: str
    ) -> np.ndarray | None:
        """Decode in n_batch parts; ``logits`` is "all" (rows returned) or "last" (one row)."""
        count = len(tokens)
        rows = np.empty((count, self.vocab_size), np.float32) if logits == "all" else None
        batch = self._batch
        features = self.features_sink is not None
        if features != self._embeddings:  # with embeddings on, every token is an output
            L.llama_set_embeddings(self._context, features)
            self._embeddings = features
        for begin in range(0, count, self.n_batch):
            end = min(count, begin + self.n_batch)
            for slot, index in enumerate(range(begin, end)):
                batch.token[slot] = int(tokens[index])
                batch.pos[slot] = int(positions[index])
                batch.n_seq_id[slot] = len(seqs[index])
                for j, seq in enumerate(seqs[index]):
                    batch.seq_id[slot][j] = seq
                batch.logits[slot] = logits == "all" or index == count - 1
            batch.n_tokens = end - begin
            mark = self._log.count
            status = L.llama_decode(self._context, batch)
            if status != 0:
                raise self._error(f"llama_decode failed with status {status}", mark)
            if rows is not None:
                part = np.ctypeslib.as_array(
                    L.llama_get_logits(self._context), shape=(end - begin, self.vocab_size)
                )
                rows[begin:end] = part
            if features:
                embeddings = L.llama_get_embeddings(self._context)
                self._capture(
                    np.ctypeslib.as_array(embeddings, shape=(end - begin, self.feature_size))
                )
        if rows is not None:
            return rows
        last = L.llama_get_logits_ith(self._context, -1)
        return np.ctypeslib.as_array(last, shape=(self.vocab_size,)).copy()

    # ------------------------------------------------------------ TreeRuntime hooks

    def _run(
        self, tokens: np.ndarray, parents: np.ndarray, positions: np.ndarray, rows: np.ndarray
    ) -> np.ndarray:
        seqs = self._assign_sequences(parents)
        return self._decode(tokens, positions, [sorted(s) for s in seqs], "all")

    def _assign_sequences(self, parents: np.ndarray) -> list[set[int]]:
        """Give each new leaf a sequence and each new node the sequences of the leaves below it.

        A leaf continuing an old leaf reuses that leaf's sequence; any other leaf gets a fresh
        sequence forked from its nearest old ancestor (or the prefix) with seq_cp.
        """
        existing = self.pending
        old_parents = self._pending_parents
        open_leaves = set(range(existing)) - set(old_parents[old_parents >= 0].tolist())
        new_seqs: list[set[int]] = [set() for _ in parents]
        has_child = np.zeros(len(parents), bool)
        for parent in parents:
            if parent >= existing:
                has_child[parent - existing] = True
        for leaf in np.flatnonzero(~has_child):
            node = existing + int(leaf)
            chain = []
            while node >= existing:
                chain.append(node - existing)
                node = int(parents[node - existing])
            seq = self._sequence_below(node, open_leaves)
            for index in chain:
                new_seqs[index].add(seq)
        self._node_seqs.extend(new_seqs)
        return new_seqs

    def _sequence_below(self, anchor: int, open_leaves: set[int]) -> int:
        """A sequence whose cells are the prefix plus ``anchor``'s path, to extend below it.

        ``open_leaves``: old leaves no new leaf has claimed yet; the first leaf below one of
        them simply continues its sequence.
        """
        if anchor in open_leaves:
            open_leaves.discard(anchor)
            return min(self._node_seqs[anchor])
        if not self._free_seqs:
            raise RuntimeUsageError(
                f"the pending tree would have more than {self.n_seq_max - 1} leaves; "
                "create the runtime with a larger n_seq_max"
            )
        seq = self._free_seqs.pop()
        if anchor == ROOT:
            L.llama_memory_seq_cp(self._memory, PREFIX_SEQ, seq, 0, self.committed)
        else:
            source = min(self._node_seqs[anchor])
            end = self.committed + int(self._pending_depths[anchor]) + 1
            L.llama_memory_seq_cp(self._memory, source, seq, 0, end)
            for ancestor in np.flatnonzero(self._pending_mask[anchor]):
                self._node_seqs[ancestor].add(seq)
        return seq

    def _reset_pending(self) -> None:
        super()._reset_pending()
        self._node_seqs: list[set[int]] = []
        self._free_seqs = list(range(self.n_seq_max - 1, PREFIX_SEQ, -1))

    def _node_logits(self, output: np.ndarray, index: int) -> np.ndarray:
        return output[index].copy()

    def _step_logits(self, output: np.ndarray) -> np.ndarray:
        return output

    def _keep_path(self, path: list[int]) -> None:
        seq = min(self._node_seqs[path[-1]])
        end = self.committed + len(path)
        L.llama_memory_seq_cp(self._memory, seq, PREFIX_SEQ, self.committed, end)
        L.llama_memory_seq_keep(self._memory, PREFIX_SEQ)

    def _drop_pending_kv(self) -> None:
        L.llama_memory_seq_keep(self._memory, PREFIX_SEQ)

    def _truncate_kv(self, length: int) -> None:
        L.llama_memory_seq_rm(self._memory, PREFIX_SEQ, length, -1)

    def _extend_committed(self, tokens: np.ndarray) -> np.ndarray:
        positions = self.committed + np.arange(len(tokens))
        return self._decode(tokens, positions, [[PREFIX_SEQ]] * len(tokens), "last")

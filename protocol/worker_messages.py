"""Messages between the daemon and a worker process: commands one way, replies the other.

Each direction is one tagged union (``op`` names the message), encoded as MessagePack in the
first ZeroMQ frame. Arrays never go inside that frame: an ``ArrayRef`` points either at an
extra frame of the same message (small arrays, sent zero-copy) or at a slot of the shared
arena (probability rows and logits). ``request`` ids let the daemon match replies to commands.

Protocol version history: 1 = the first one; 2 = spare cores (``Hello.spare_cores``, the
``spare_cores`` flag of the compute commands); 3 = ``Decode`` (the target decoding alone);
4 = ``Ready.special_tokens`` (control tokens, which the daemon never renders as text);
5 = log-probabilities (``Decode.logprobs``); 6 = the target's features for a draft head
(``features`` fields: the hidden state entering the LM head, float32 rows, one per position);
21 = the prompt's own log-probabilities (``Prefill.prompt_logprobs``, and
``Prefilled``'s); 22 = a request's grammar in ``Draft`` and ``Decode`` (``GrammarAt``: drafts
and the target alone choose only tokens it allows), its cost in their replies (``GrammarCost``),
``Decode.ends`` (decoding alone may stop at an end token); 23 = several sequences
(``Load.sequences``, ``Ready.sequences``, and the ``sequence`` each compute command works on:
a request's own KV cache, sampler and grammar in the worker, several requests at once);
24 = ``Verified.batch_rows`` (the rows a batched forward held); 25 = HCMP's split in the torch
worker (``TorchSettings.split_ratio``, ``split_cache``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from hetspec.protocol.arena import ArenaLayout, ArrayRef
from hetspec.protocol.sampling import SamplingParams, TokenLogprob
from hetspec.protocol.vocab import VocabInfo

PROTOCOL_VERSION = 25


class GrammarAt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request's grammar (llguidance's text) and where its output starts in the sequence:
    the committed tokens from ``start`` on are the text it has matched so far."""

    text: str
    start: int


class GrammarCost(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a command's grammar cost the worker: masks computed, their milliseconds (within
    ``elapsed_ms``), and the milliseconds to compile the grammar (a request's first command)."""

    masks: int
    mask_ms: float
    compile_ms: float = 0.0


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    pass


# ---------------------------------------------------------------- runtime settings


# the values a runtime setting may take: a typo fails when the configuration is read, with
# the choices listed, not when a worker loads (or, for "auto", never: another runtime won)
FlashAttention = Literal["auto", "on", "off"]
CacheType = Literal["f32", "f16", "q8_0"]
TorchDtype = Literal["auto", "float32", "bfloat16", "float16"]
MatmulKernel = Literal["torch", "triton"]
AttentionKind = Literal["gathered", "split"]
WeightFormat = Literal["dtype", "int8"]


class LlamaCppSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="llama.cpp"):
    n_ctx: int | None = None  # None: min(the model's training context, 8192)
    n_batch: int = 512
    n_ubatch: int | None = None
    threads: int | None = None  # None: the cores the worker owns
    threads_batch: int | None = None
    n_seq_max: int = 16
    mmap: bool = True
    # None: by role. A verifying llama.cpp gets flash attention "off", an f16 K cache and an
    # f32 V cache: a tree's logits then stay closest to each path's evaluated on its own, so
    # greedy output is the target's own token for token (the types compared:
    # docs/design-notes.md, "llama.cpp's settings").
    # A drafter gets "auto" and "f16" (faster; a draft only has to be good, not exact);
    # "auto" means "off" where no layer is offloaded (on the CPU it only slows llama.cpp).
    flash_attention: FlashAttention | None = None
    kv_type: CacheType | None = None  # the KV cache's type (both K and V unless v_type says)
    v_type: CacheType | None = None
    gpu_layers: int = 0  # layers llama.cpp offloads to a GPU (a GPU build only); -1: all
    # HOST:PORT of llama.cpp rpc-servers: the offloaded layers (gpu_layers) run there
    rpc_servers: tuple[str, ...] = ()


class MatmulTiling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the Triton matmul cuts a weight (workers/runtimes/torch_runtime/skinny_matmul.py,
    ``Tiling``); None keeps the kernel's default. A tiling may change a result's bits, never
    with the row count: one tiling serves a whole model, so losslessness holds."""

    block_n: int | None = None
    block_k: int | None = None
    programs_per_sm: int | None = None
    warps: int | None = None
    stages: int | None = None


class TorchSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="torch"):
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    dtype: TorchDtype = "auto"
    max_context: int | None = None
    threads: int | None = None
    compile: bool = False
    # On CUDA: forwards in fixed shapes replayed as CUDA graphs (workers/runtimes/torch_runtime/
    # static_forward.py); fixed_width > 0 makes every forward that many rows so a token's
    # logits never depend on what it is verified with (None: 16 for a verifier on CUDA, else
    # width buckets); span_buckets False attends over the whole context in every forward.
    cuda_graphs: bool = True
    fixed_width: int | None = None
    span_buckets: bool = True
    # In fixed width: a chain (the target alone, a chain's verification) in a forward that
    # gathers one path, not the several a tree needs (cheaper; see static_forward.py)
    chain_forwards: bool = True
    # ... and where that path is the cache's own order (the target alone, a chain verified
    # after the committed tokens) attend to the cache in place, with no gather, if a check at
    # load finds the same bits as through the gather
    chain_in_place: bool = True
    # "split": fixed-width forwards read the cache in place up to a point each row's position
    # fixes and gather only its path's last 33-48 keys (workers/runtimes/torch_runtime/
    # split_attention.py): any tree in one forward, bit-identical to its rows on their own by
    # construction, at about a chain's cost; "gathered": paths gathered as above
    attention: AttentionKind = "gathered"
    # "triton": linear layers of at most 16 rows (every fixed-width forward) in hetspec's
    # Triton kernel, which reads each weight once for all rows in an order that does not
    # depend on the rows (workers/runtimes/torch_runtime/skinny_matmul.py); "torch": cuBLAS
    matmul: MatmulKernel = "torch"
    matmul_tiling: MatmulTiling | None = None  # with "triton"; bench_matmul times tilings
    # "int8": every linear layer's weight (the output head's too) in int8 with a float32
    # scale per output row, read by that Triton kernel (workers/runtimes/torch_runtime/
    # int8_weights.py): half bfloat16's bytes to stream, and the int8 model's text (its
    # target alone is the reference); "dtype": the weights in the activations' dtype
    weights: WeightFormat = "dtype"
    # Set by the daemon for the worker that verifies: dtype "auto" is then bfloat16 in fixed
    # shapes on CUDA (width-invariant), float32 on the CPU.
    verifies: bool = False
    # HCMP, Ghidorah's split (docs/architecture.md "Ghidorah"): the GPU side's share of every
    # linear's output columns, the rest computed on the CPU at the same time, and each attention
    # head's draft-tree part on the CPU (None: unsplit). "auto": ARCA measures each verification
    # width's cheapest share at load (kept in split_cache, per model and box) and each forward
    # takes its width's. A split that cannot run here is refused in one line (in the worker's
    # device words) and the worker verifies unsplit.
    split_ratio: float | Literal["auto"] | None = None
    split_cache: str | None = None  # the folder of ARCA's profiles (the daemon sets its cache's)


class NativeSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="native"):
    n_ctx: int | None = None  # None: min(the model's training context, 8192)
    threads: int | None = None  # None: the cores the worker owns
    # the most capable kernels to use: None the best this CPU runs, else "vnni" (AVX-512 VNNI),
    # "avx_vnni", "avx2", "dotprod" (aarch64) or "portable" (a cap, for comparing them; see
    # hetspec.native.kernels)
    simd: Literal["vnni", "avx_vnni", "avx2", "dotprod", "portable"] | None = None


class HeadSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="head"):
    """A draft head (Dovetail's; ``Load.model`` is its folder) drafting for ``target``, the
    target's model folder, whose embedding, final norm and LM head it borrows."""

    target: str
    device: str = "auto"
    dtype: TorchDtype = "auto"
    max_context: int | None = None
    threads: int | None = None


RuntimeSettings = LlamaCppSettings | TorchSettings | NativeSettings | HeadSettings


# ---------------------------------------------------------------- daemon -> worker


class Load(_Message, tag="load"):
    """Load a model (replacing any loaded one); answered by ``Ready`` or ``Failed``."""

    model: str
    settings: RuntimeSettings
    arena: ArenaLayout | None = None
    # sequences served at once, each with its own cache of ``Ready.context`` tokens, its
    # sampler and its grammar; the compute commands name theirs (0 .. sequences - 1)
    sequences: int = 1


class Prefill(_Message, tag="prefill"):
    """Make the committed sequence ``tokens`` (reusing a common prefix); starts a request's
    sampling: with a ``seed``, each token's randomness is keyed by (seed, position), so every
    process and mode samples the same text; None: draws in order from the OS's entropy.
    With ``out`` >= 0 the float32 logits after the last token go to that arena slot (the
    first token can be chosen at once)."""

    request: int
    tokens: list[int]
    seed: int | None = None
    out: int = -1
    spare_cores: bool = False  # the other worker is idle: compute on its cores too
    report_features: bool = False  # reply with the features of the positions evaluated
    # a draft head's input: the target's features of positions features_start.. (a frame)
    features: ArrayRef | None = None
    features_start: int = 0
    # 0..20: evaluate the whole prompt afresh and reply with each token's log-probability
    # after the first (given the tokens before it) and that many alternatives (protocol 21)
    prompt_logprobs: int | None = None
    sequence: int = 0  # which of the worker's sequences (Load.sequences)


class _Shape(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="shape"):
    pass


class Chains(_Shape, tag="chains"):
    """``branches`` chains of ``steps`` tokens each, one forward a step; their first tokens
    are the top ``branches`` (greedy) or the sampler's candidates, then each chain draws on."""

    steps: int
    branches: int = 1


class RuleBranches(_Shape, tag="rule"):
    """DuoDecoding's dynamic multi-sequence drafting: the drafter picks k <= ``most`` chains by
    its uncertainty (threshold scale ``scale``), k chains of ``budget // k`` tokens; the
    reply's rows say which k."""

    budget: int
    most: int
    scale: float


class DynamicTree(_Shape, tag="tree"):
    """EAGLE-2's dynamic tree: ``depth`` layers, each expanding the ``top_k`` likeliest nodes;
    the ``size`` likeliest nodes come back ranked (``Drafted.parents``, ``acceptance``), scored
    by ``first_accept`` (see speculative/drafting/dynamic_tree.py) where given, else by the
    draft's path probability."""

    depth: int
    top_k: int
    size: int
    first_accept: float | None = None


class RunAhead(_Shape, tag="run_ahead"):
    """Continue a pending draft below ``token`` (drafted, not evaluated yet) as a child of
    pending node ``node`` (-1: the committed end), keeping the pending tree, for ``steps``
    tokens: how a drafter drafts the next round while its last draft is verified. It appends
    nothing."""

    node: int
    token: int
    steps: int


DraftShape = Chains | RuleBranches | DynamicTree | RunAhead


class Draft(_Message, tag="draft"):
    """Draft ``shape`` (one of four: decoded strictly, each with only its own fields); the
    probability rows go to arena slot ``out``. ``append`` is first made to follow the
    committed sequence (the tokens the last round emitted: the accepted drafted ones are
    reused, not recomputed), saving a round trip."""

    request: int
    shape: DraftShape
    sampling: SamplingParams
    out: int
    append: list[int] = []
    spare_cores: bool = False
    # a draft head's input: row i is the target's feature of the position before append[i]
    features: ArrayRef | None = None
    grammar: GrammarAt | None = None  # drafted tokens keep the text valid (Chains only)
    sequence: int = 0  # which of the worker's sequences (Load.sequences)


class Decode(_Message, tag="decode"):
    """The target decoding alone: after making ``append`` follow the committed sequence (as
    ``Draft`` does), draw ``steps`` tokens, one forward each, committing each as it is drawn
    but the last, which is drawn and not evaluated (the next ``append`` starts with it).
    Greedy draws are the argmax of the logits, as verification's are. No probability rows;
    with ``logprobs`` (0..20), each token's log-probability and that many alternatives."""

    request: int
    steps: int
    sampling: SamplingParams
    append: list[int] = []
    spare_cores: bool = False
    logprobs: int | None = None
    report_features: bool = False  # reply with the features of the positions evaluated
    grammar: GrammarAt | None = None  # every token drawn keeps the text valid
    # the ids that end the request: the worker may stop once it draws one (the last, not
    # evaluated), since nothing after it is emitted
    ends: list[int] = []
    sequence: int = 0  # which of the worker's sequences (Load.sequences)


class SampledWalk(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A sampled verdict taken in the verifier (protocol 19), as ``argmax_only`` is for
    greedy: the tree's first node is the last round's bonus, the draft grows below it, and
    row r (after node r) chooses the token at ``position`` + its depth. Only the rows the walk
    reaches leave the runtime, warped by ``sampling``; nothing goes to the arena, and
    ``Verified.path`` and ``bonus`` say what the target keeps. ``keyed``: the request's keyed
    choices (the seed of the verifier's ``Prefill``). Otherwise speculative sampling, its
    uniforms from a generator seeded with ``seed``, node i + 1's draft row at
    ``draft_rows[i]`` of ``draft`` (the drafter's rows, flattened to (rows, vocab))."""

    sampling: SamplingParams
    position: int
    keyed: bool = False
    seed: int = 0  # 0 .. 2**63 - 1
    draft: ArrayRef | None = None
    draft_rows: list[int] = []


class VerifyTree(_Message, tag="verify"):
    """Evaluate a token tree (``parents[i]`` = -1 for the committed prefix); the float32
    logits of every node go to arena slot ``out``, after the logits that follow the committed
    prefix itself when ``root_row`` (then row i + 1 belongs to node i). With ``argmax_only``
    (all greedy verification needs) each of those rows' argmax comes back instead, in
    ``Verified.argmax``, and nothing goes to the arena: a large vocabulary's rows are
    megabytes a round to copy from a GPU and scan."""

    request: int
    tokens: list[int]
    parents: list[int]
    out: int
    extend: bool = False
    root_row: bool = False
    commit: list[int] = []  # pending nodes (a path) to keep before the tree is evaluated
    spare_cores: bool = False
    features_out: int = -1  # >= 0: every node's feature (nodes, feature size) to this slot
    argmax_only: bool = False
    walk: SampledWalk | None = None
    sequence: int = 0  # which of the worker's sequences (Load.sequences)


class Commit(_Message, tag="commit"):
    """Keep the pending nodes ``nodes`` (a path) and then append ``tokens`` after them."""

    request: int
    nodes: list[int] = []
    tokens: list[int] = []
    sequence: int = 0  # which of the worker's sequences (Load.sequences)


class Rollback(_Message, tag="rollback"):
    request: int
    length: int
    sequence: int = 0  # which of the worker's sequences (Load.sequences)


class Tokenize(_Message, tag="tokenize"):
    request: int
    text: str
    add_special: bool = True


class Echo(_Message, tag="echo"):
    """Copy the array at ``data`` into slot ``out`` (or back as a frame): the round-trip probe.
    ``hold_us``: computing that long first (as a verification or a draft does, while the
    daemon waits)."""

    request: int
    data: ArrayRef
    out: int = -1
    hold_us: float = 0.0


class Cancel(_Message, tag="cancel"):
    """Stop work on ``request`` at the next step (handled by the worker's I/O thread)."""

    request: int


class Shutdown(_Message, tag="shutdown"):
    pass


Command = (
    Load
    | Prefill
    | Draft
    | Decode
    | VerifyTree
    | Commit
    | Rollback
    | Tokenize
    | Echo
    | Cancel
    | Shutdown
)


# ---------------------------------------------------------------- worker -> daemon


class Hello(_Message, tag="hello"):
    """First message of every worker, before it loads anything."""

    protocol: int
    pid: int
    runtime: str  # "llama.cpp" or "torch"
    cores: list[int]
    # the other worker's cores, which this one computes on too when a command says it is idle
    spare_cores: list[int] = []


class Ready(_Message, tag="ready"):
    model: str
    device: str
    vocab: VocabInfo
    context: int  # tokens the loaded context holds
    threads: int
    load_ms: float
    token_bytes: list[bytes]  # what every id stands for, so the daemon can detokenize
    special_tokens: list[int] = []  # control tokens: they end a turn or render as nothing
    sequences: int = 1  # sequences served at once: Load's, or fewer where the runtime cannot


class Heartbeat(_Message, tag="heartbeat"):
    sent: float  # time.monotonic() on the worker, for liveness only
    busy: int | None = None  # the request being computed, if any


class Prefilled(_Message, tag="prefilled"):
    request: int
    reused: int
    committed: int
    elapsed_ms: float
    logits: ArrayRef | None = None  # (1, vocab) when the command gave ``out``
    # with report_features: (evaluated, feature size), of positions features_start.. (a frame)
    features: ArrayRef | None = None
    features_start: int = 0
    # with prompt_logprobs: one per prompt token after the first, in order
    prompt_logprobs: list[TokenLogprob] = []


class Drafted(_Message, tag="drafted"):
    request: int
    tokens: list[list[int]]  # (branches, steps)
    nodes: list[list[int]]  # pending-tree node of each token, -1 where not evaluated
    probs: ArrayRef
    elapsed_ms: float
    # of elapsed_ms, the catch-up: the command's ``append`` but the forward of its last new
    # token where the draft ran that one (the first draft token is drawn from its logits)
    append_ms: float = 0.0
    forwards: int = 0  # the forwards in elapsed_ms - append_ms (each one token of a branch)
    root: int = -1  # the pending node the branches hang from (-1: the committed end)
    # a tree draft: one row of ``tokens`` and ``nodes`` holds the nodes ranked best first
    # (parents before children); ``parents`` per node (-1: the committed end), and each
    # node's score: its estimated chance of being accepted along its path (see
    # speculative/drafting/dynamic_tree.py); ``probs`` is then empty (nodes are chosen, not drawn)
    parents: list[int] = []
    acceptance: list[float] = []
    grammar: GrammarCost | None = None  # with the command's grammar: its masks' cost


class Decoded(_Message, tag="decoded"):
    request: int
    tokens: list[int]  # all but the last committed
    elapsed_ms: float  # the worker's own time, the append included
    logprobs: list[TokenLogprob] = []  # one per token, when the command asked
    features: ArrayRef | None = None  # with report_features, as Prefilled's
    features_start: int = 0
    grammar: GrammarCost | None = None  # with the command's grammar: its masks' cost


class Verified(_Message, tag="verified"):
    request: int
    logits: ArrayRef | None  # None with argmax_only
    elapsed_ms: float
    features: ArrayRef | None = None  # with features_out: one row per tree node, in order
    argmax: list[int] = []  # with argmax_only: each row's argmax (the first of equal ones)
    path: list[int] = []  # with a walk: the accepted draft nodes (node 1 of the tree is 0)
    bonus: int = -1  # with a walk: the target's own token after the path
    # rows of the forward that evaluated this tree, every sequence's (0: its own alone):
    # what ``elapsed_ms`` paid for
    batch_rows: int = 0


class Committed(_Message, tag="committed"):
    request: int
    committed: int
    elapsed_ms: float


class Tokenized(_Message, tag="tokenized"):
    request: int
    tokens: list[int]


class Echoed(_Message, tag="echoed"):
    request: int
    data: ArrayRef


class Failed(_Message, tag="failed"):
    """A command could not be carried out. ``kind``: "usage" (the command does not fit the
    state: context full, not a path, ...), "load" (the model cannot be loaded), "cancelled",
    "protocol" (a malformed message) or "internal" (a bug: the message says where)."""

    request: int | None
    kind: str
    message: str


Reply = (
    Hello
    | Ready
    | Heartbeat
    | Prefilled
    | Drafted
    | Decoded
    | Verified
    | Committed
    | Tokenized
    | Echoed
    | Failed
)

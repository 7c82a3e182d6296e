"""``hetspec models check TARGET DRAFT``: can these two models be served as a pair, where?

Each model is a Hugging Face folder (``config.json``, ``*.safetensors``, ``tokenizer.json``),
a GGUF file, or a folder holding both exports. The check says what each placement and
runtime would load (a runtime that needs the missing export is marked so), whether the
pair shares a vocabulary (the daemon's own start-up check, on vocabularies read by the
workers' own code in a process of their own), the context each allows, the memory each side
would take, and prints a ``hetspecd.toml`` for the pair. Exit status 0 when the default
placement can serve the pair, 1 when not (a GGUF the daemon would refuse at start-up, its
metadata contradicting its tensors, gets that one line alone), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

from hetspec.daemon.config import ConfigError, DaemonConfig, model_paths_of
from hetspec.daemon.load.head_choice import BUNDLED_HEAD, TARGET_HEAD, mismatch
from hetspec.daemon.load.model_facts import ModelFacts, read_model_facts
from hetspec.protocol import VocabReport
from hetspec.protocol.gguf_checks import GGUFMetadataError, ModelShape, check_model_file
from hetspec.speculative.drafting.vocab_match import incompatibilities

DEFAULT_CONTEXT_LIMIT = 8192  # what the workers load when no context is configured
# what hetspec's native kernels compute (workers/runtimes/native_runtime.py)
NATIVE_FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
# ... and of the model_types the torch runtime reads (workers/runtimes/torch_runtime/config.py)
TORCH_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
NATIVE_TENSOR_TYPES = frozenset(
    {
        "F32",
        "F16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ4_NL",
        "IQ4_XS",
    }
)
NATIVE_ROPE_SCALINGS = ("none", "linear")


class CheckError(ValueError):
    pass


class CannotServe(ValueError):
    """A model file the daemon would refuse at start-up; the message says why, in its words."""


@dataclass(frozen=True)
class Model:
    """One model's exports: ``folder`` for torch, ``gguf`` for llama.cpp and the native
    kernels; either may be missing."""

    name: str  # "target" or "draft"
    folder: Path | None
    gguf: Path | None
    folder_facts: ModelFacts | None
    gguf_facts: ModelFacts | None
    gguf_shape: ModelShape | None = None  # the GGUF's checked numbers (a checked architecture)

    @property
    def facts(self) -> ModelFacts:
        return self.gguf_facts or self.folder_facts


def find_exports(name: str, path: Path) -> Model:
    """The folder and the GGUF file ``path`` names (a GGUF next to ``config.json`` is both),
    as ``hetspecd --target/--draft`` reads it."""
    try:
        exports = model_paths_of(path)
    except ConfigError as error:
        raise CheckError(f"{name}: {error}") from None
    folder = Path(exports.folder) if exports.folder else None
    gguf = Path(exports.gguf) if exports.gguf else None
    try:
        folder_facts = read_model_facts(folder) if folder else None
        gguf_facts = read_model_facts(gguf) if gguf else None
    except ValueError as error:
        raise CheckError(f"{name}: {error}") from None
    try:  # the daemon's own start-up check of the file (daemon/supervision/supervisor.py)
        shape = check_model_file(gguf) if gguf else None
    except GGUFMetadataError as error:
        raise CannotServe(str(error)) from None
    return Model(name, folder, gguf, folder_facts, gguf_facts, shape)


def read_vocabs(paths: dict[tuple[str, str], Path], timeout_s: float = 120.0) -> dict:
    """Each vocabulary as a worker reads it (``python -m hetspec.workers.tools.describe KIND
    PATH``), all at once; keyed like ``paths`` by (model, "gguf" or "folder")."""
    describe = [sys.executable, "-m", "hetspec.workers.tools.describe"]
    running = {
        key: subprocess.Popen(
            [*describe, key[1], str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        for key, path in paths.items()
    }
    reports = {}
    for key, process in running.items():
        try:
            out, _ = process.communicate(timeout=timeout_s)
            reports[key] = msgspec.json.decode(out.strip().splitlines()[-1], type=VocabReport)
        except (subprocess.TimeoutExpired, IndexError, msgspec.DecodeError) as error:
            process.kill()
            process.wait()
            reports[key] = VocabReport(str(paths[key]), error=f"reading it failed ({error})")
    return reports


def count_of(facts: ModelFacts, key: str) -> int | None:
    """The positive whole number ``{family}.{key}`` of ``facts``, or None (absent, or something
    else in a file of an architecture protocol/gguf_checks.py does not check)."""
    value = facts.info.get(f"{facts.family}.{key}")
    return value if type(value) is int and value > 0 else None


def kv_bytes_per_token(facts: ModelFacts, element_bytes: float) -> int | None:
    """K and V of one position across all layers (``element_bytes`` per K and V element)."""
    layers = count_of(facts, "block_count")
    heads = count_of(facts, "attention.head_count")
    kv_heads = count_of(facts, "attention.head_count_kv") or heads
    width = count_of(facts, "embedding_length")
    if not (layers and heads and kv_heads and width):
        return None
    head_dim = count_of(facts, "attention.key_length") or width // heads
    return int(layers * kv_heads * head_dim * element_bytes)


def _gb(count: float) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e8 else f"{count / 1e6:.1f} MB"


@dataclass(frozen=True)
class Side:
    """One worker's load: which runtime, which export, how much memory."""

    role: str  # "drafts" or "verifies"
    worker: str  # "CPU worker" or "GPU worker"
    runtime: str  # "llama.cpp", "native", "torch"
    model: Model

    @property
    def export(self) -> Path | None:
        return self.model.folder if self.runtime == "torch" else self.model.gguf

    def memory(self, context: int) -> str:
        if self.export is None:
            return ""
        if self.runtime == "torch":  # the worker's default dtype: f32 on a CPU, bf16 on CUDA
            parameters = self.model.folder_facts.parameters
            on_cpu = self._sized(parameters * 4, 4.0, context)
            return (
                f"{on_cpu} in float32 on a CPU, {self._sized(parameters * 2, 2.0, context)} "
                "in bfloat16 on CUDA"
            )
        # llama.cpp's cache types by role (a verifier: f16 K, f32 V)
        element = 3.0 if self.role == "verifies" else 2.0
        return self._sized(self.model.gguf_facts.size_bytes, element, context)

    def _sized(self, weights: int, element: float, context: int) -> str:
        """Weights plus a ``context``-token KV cache of ``element`` bytes a K and V element."""
        per_token = kv_bytes_per_token(self.model.facts, element)
        kv = per_token * context if per_token is not None else None
        total = weights + (kv or 0)
        cache = f" + KV cache {_gb(kv)}" if kv is not None else " + KV cache (unknown)"
        return f"{_gb(total)} (weights {_gb(weights)}{cache})"

    def unusable(self) -> str | None:
        """Why this side cannot run, or None."""
        torch = self.runtime == "torch"
        if self.export is None:
            return "needs " + (
                "a model folder (config.json, safetensors)" if torch else "a GGUF file"
            )
        if torch:
            family = self.model.folder_facts.family
            if family not in TORCH_MODEL_TYPES:
                return (
                    f"the torch runtime reads {'/'.join(TORCH_MODEL_TYPES)} folders, not {family}"
                )
            return None
        return self._native_unusable() if self.runtime == "native" else None

    def _native_unusable(self) -> str | None:
        """Why the native kernels cannot run the GGUF (its family, tensor types, numbers)."""
        facts, shape = self.model.gguf_facts, self.model.gguf_shape
        if facts.family not in NATIVE_FAMILIES:
            return f"the native kernels run {'/'.join(NATIVE_FAMILIES)} GGUFs, not {facts.family}"
        if unread := sorted(facts.tensor_types - NATIVE_TENSOR_TYPES):
            known = ", ".join(sorted(NATIVE_TENSOR_TYPES))
            return (
                f"the native kernels read {known} tensors; this {facts.quantization} "
                f"file has {', '.join(unread)}"
            )
        if shape is not None and shape.experts:
            return f"the native kernels run dense models; this one has {shape.experts} experts"
        if shape is not None and shape.rope_scaling not in NATIVE_ROPE_SCALINGS:
            return (
                f"the native kernels scale RoPE {'/'.join(NATIVE_ROPE_SCALINGS)}, not "
                f"{shape.rope_scaling}"
            )
        return None

    def line(self, context: int) -> str:
        torch = self.runtime == "torch"
        what = f"{self.worker} {self.role} with {self.runtime} on the {self.model.name}'s " + (
            "folder" if torch else "GGUF"
        )
        if (reason := self.unusable()) is not None:
            return f"    {what}: NO, {reason}"
        return f"    {what}: {self.export.name}, {self.memory(context)}{self._or_native()}"

    def _or_native(self) -> str:
        """The drafting CPU worker runs llama.cpp or the native kernels, whichever drafts a
        token faster when the daemon starts (``cpu_runtime = "auto"``)."""
        if (self.role, self.worker, self.runtime) != ("drafts", "CPU worker", "llama.cpp"):
            return ""
        if Side(self.role, self.worker, "native", self.model).unusable() is not None:
            return ""
        return ' (or the native kernels, where they draft faster: cpu_runtime "auto")'


def placements(target: Model, draft: Model) -> dict[str, list[list[Side]]]:
    """For each placement, the alternatives of the GPU worker's runtime: each a pair of
    sides (the CPU worker's llama.cpp, which may draft on the native kernels instead)."""
    return {
        "draft-cpu": [
            [
                Side("drafts", "CPU worker", "llama.cpp", draft),
                Side("verifies", "GPU worker", runtime, target),
            ]
            for runtime in ("torch", "llama.cpp", "native")
        ],
        "draft-gpu": [
            [
                Side("verifies", "CPU worker", "llama.cpp", target),
                Side("drafts", "GPU worker", runtime, draft),
            ]
            for runtime in ("torch", "llama.cpp")
        ],
    }


def describe_model(model: Model) -> list[str]:
    facts = model.facts
    lines = [
        f"{model.name}: {facts.family}, {facts.parameter_size} parameters, "
        f"trained context {facts.context_length or 'unknown'}"
    ]
    for kind, path, found in (
        ("folder", model.folder, model.folder_facts),
        ("GGUF", model.gguf, model.gguf_facts),
    ):
        if path is None:
            lines.append(f"  {kind}: none")
        else:
            lines.append(f"  {kind}: {path} ({found.quantization}, {_gb(found.size_bytes)})")
    return lines


def check(target: Model, draft: Model) -> tuple[list[str], bool]:
    """The report's lines, and whether the default placement (draft-cpu) can serve."""
    lines = [*describe_model(target), *describe_model(draft)]
    # vocabularies as the workers read them: each GGUF (llama.cpp) and each folder (torch)
    reports = read_vocabs(
        {
            (model.name, kind): path
            for model in (target, draft)
            for kind, path in (("gguf", model.gguf), ("folder", model.folder))
            if path is not None
        }
    )
    failures = [f"  {name} {kind}: {r.error}" for (name, kind), r in reports.items() if r.error]
    vocabs = {key: r.vocab for key, r in reports.items() if r.vocab is not None}
    problems = sorted(
        {
            problem
            for (name_a, _), a in vocabs.items()
            if name_a == "draft"
            for (name_b, _), b in vocabs.items()
            if name_b == "target"
            for problem in incompatibilities(a, b)
        }
    )
    shared = not problems and not failures
    if shared:
        any_vocab = next(iter(vocabs.values()))
        lines.append(
            f"vocabulary: shared ({any_vocab.kind}, {any_vocab.real_size} tokens), "
            "as the daemon checks at start-up"
        )
    else:
        lines.append("vocabulary: NOT shared, the daemon would refuse the pair:")
        lines += failures + [f"  {problem}" for problem in problems]
    trained = target.facts.context_length, draft.facts.context_length
    contexts = [c for c in trained if c]
    context = min([*contexts, DEFAULT_CONTEXT_LIMIT])
    lines.append(
        f"context: target {trained[0] or '?'}, draft {trained[1] or '?'}; "
        f"served by default: {context} tokens (n_ctx / max_context set it)"
    )
    default_ok = False
    for placement, alternatives in placements(target, draft).items():
        default = " (the default)" if placement == "draft-cpu" else ""
        lines.append(f"{placement}{default}:")
        for sides in alternatives:
            usable = shared and all(side.unusable() is None for side in sides)
            default_ok |= usable and placement == "draft-cpu"
            runtime = sides[1].runtime
            verdict = "can serve" if usable else "cannot serve"
            lines.append(f'  gpu_runtime "{runtime}": {verdict}')
            lines += [side.line(context) for side in sides]
    lines += describe_heads(target)
    vocab = count_of(target.facts, "vocab_size")
    if vocab:
        defaults = DaemonConfig()
        slots, nodes = defaults.arena_slots, defaults.max_tree_nodes
        arena = slots * nodes * vocab * 4
        lines.append(
            f"shared memory for probability rows: {_gb(arena)} (arena_slots {slots} "
            f"x max_tree_nodes {nodes} x {vocab} x 4 bytes)"
        )
    lines += ["", "hetspecd.toml:", *example_config(target, draft)]
    return lines, default_ok


def check_alone(target: Model) -> tuple[list[str], bool]:
    """The report of a target served without a draft model (it drafts from the text itself:
    ``model_free_draft``), and whether it can be served."""
    lines = describe_model(target)
    reports = read_vocabs(
        {
            ("target", kind): path
            for kind, path in (("gguf", target.gguf), ("folder", target.folder))
            if path is not None
        }
    )
    failures = [f"  target {kind}: {r.error}" for (_, kind), r in reports.items() if r.error]
    if failures:
        lines += ["vocabulary: cannot be read, the daemon would refuse the target:", *failures]
    context = min([c for c in (target.facts.context_length,) if c] + [DEFAULT_CONTEXT_LIMIT])
    lines.append(f"context: served by default: {context} tokens (n_ctx / max_context set it)")
    lines.append(
        "no draft model: one worker verifies, and the daemon drafts from the prompt and the "
        'text so far (model_free_draft "continuation-tree"); modes adaptive and '
        "autoregressive"
    )
    ok = False
    for runtime in ("torch", "llama.cpp", "native"):
        side = Side("verifies", "GPU worker", runtime, target)
        usable = not failures and side.unusable() is None
        ok |= usable
        lines.append(f'  gpu_runtime "{runtime}": {"can serve" if usable else "cannot serve"}')
        lines.append(side.line(context))
    lines += ["", "hetspecd.toml:", *example_config(target)]
    return lines, ok


def describe_heads(target: Model) -> list[str]:
    """Which draft head draft-gpu would draft with (``draft_head = "auto"``, torch), and
    why each candidate does or does not match the target."""
    heading = 'draft head (draft-gpu, gpu_runtime "torch", draft_head "auto"):'
    if target.folder is None:
        return [heading, "  none: a head reads the target's folder (its LM head), there is none"]
    lines, chosen = [heading], None
    for candidate in (target.folder / TARGET_HEAD, BUNDLED_HEAD):
        if not candidate.is_dir():
            lines.append(f"  {candidate}: absent")
            continue
        problem = mismatch(candidate, target.folder)
        if problem is None and chosen is None:
            chosen = candidate
        lines.append(f"  {candidate}: {'matches' if problem is None else problem}")
    lines.append(f"  drafts with: {chosen or 'the draft model (no head matches)'}")
    return lines


def example_config(target: Model, draft: Model | None = None) -> list[str]:
    """The configuration that serves these models (without a draft: none, as a target named
    alone has)."""
    lines = []
    for model in (target, draft) if draft is not None else (target,):
        lines.append(f"[{model.name}]")
        lines.append(f'folder = "{model.folder or ""}"  # torch loads this')
        lines.append(f'gguf = "{model.gguf or ""}"  # llama.cpp and the native kernels load this')
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hetspec models check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "target", type=Path, help="the target: a model folder, a GGUF file, or a folder with both"
    )
    parser.add_argument(
        "draft",
        type=Path,
        nargs="?",
        help="the draft, likewise; none: the target served alone, drafting from its own text",
    )
    args = parser.parse_args(argv)
    try:
        target = find_exports("target", args.target)
        draft = None if args.draft is None else find_exports("draft", args.draft)
    except CheckError as error:
        print(f"hetspec models check: {error}", file=sys.stderr)
        return 2
    except CannotServe as error:
        print(f"hetspec models check: cannot serve: {error}", file=sys.stderr)
        return 1
    lines, ok = check(target, draft) if draft is not None else check_alone(target)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

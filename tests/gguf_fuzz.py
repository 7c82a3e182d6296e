"""Seeded crafted GGUF files (#70): a small real file's metadata values, value types and tensor
infos mutated, and each party's verdict on each file.

``draw_mutations(seed, count)`` draws the files' mutations as JSON-able lists, so a failure names
what its file had changed. ``python tests/gguf_fuzz.py MUTATIONS VERDICTS`` builds the files one
at a time (each deleted once judged) and writes one JSON line per file: the verdict of the
shared check, of the daemon's start-up check, of ``hetspec models check``'s reading of the file,
of the native kernels' loader and of llama.cpp's, then one line with the process's peak RSS.
One process for all files: the imports are paid once, and its peak RSS is the peak over every
load.
"""

from __future__ import annotations

import json
import math
import random
import struct
import sys
import traceback
from pathlib import Path

import numpy as np
from gguf_crafting import SCALAR_FORMATS, RawGGUF, T

from hetspec.daemon.config import BUNDLED_MODELS

BASES = (
    BUNDLED_MODELS / "draft" / "draft-q8_0.gguf",
    BUNDLED_MODELS / "target" / "target-q8_0.gguf",
)
INTEGERS = {
    T.UINT8: (8, False),
    T.INT8: (8, True),
    T.UINT16: (16, False),
    T.INT16: (16, True),
    T.UINT32: (32, False),
    T.INT32: (32, True),
    T.UINT64: (64, False),
    T.INT64: (64, True),
}
REALS = (T.FLOAT32, T.FLOAT64)
# keys the loaders read that the bases lack: their types as llama.cpp writes them, a value
ADDED_KEYS = {
    "llama.attention.key_length": (T.UINT32, 32),
    "llama.attention.value_length": (T.UINT32, 32),
    "llama.attention.head_count_kv": (T.UINT32, 2),
    "llama.rope.scaling.type": (T.STRING, "linear"),
    "llama.rope.scaling.factor": (T.FLOAT32, 2.0),
    "llama.attention.sliding_window": (T.UINT32, 4),
    "llama.vocab_size": (T.UINT32, 4096),
    "general.alignment": (T.UINT32, 32),
}
LONG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


def _wrapped(value: int, kind: T) -> int:
    """``value`` as the bits of an integer of type ``kind`` read back."""
    bits, signed = INTEGERS[kind]
    value %= 2**bits
    return value - 2**bits if signed and value >= 2 ** (bits - 1) else value


def _integer(rng: random.Random, original: int) -> int:
    return rng.choice(
        [
            0,
            1,
            2,
            3,
            -1,
            original + 1,
            original - 1,
            original * 2,
            original // 2,
            original * 3,
            2 ** rng.randint(2, 40),
            2**28,
            2**17,
            2**31 - 1,
            2**32 - 1,
            2**63 - 1,
            2**64 - 1,
            rng.randint(0, 2**16),
        ]
    )


def _real(rng: random.Random, original: float) -> float:
    return rng.choice(
        [
            0.0,
            -0.0,
            -1.0,
            math.nan,
            math.inf,
            -math.inf,
            1e-30,
            1e30,
            1.0,
            original * 2,
            original / 2,
            3.5e38,
        ]
    )


def _float32(value: float) -> float:
    """``value`` as a float32 holds it (too large: infinity)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _value_of(rng: random.Random, kind: T, original: object) -> tuple[object, T | None]:
    """A value of type ``kind`` near or far from ``original``, and an array's item type."""
    number = original if type(original) in (int, float) and math.isfinite(original) else 7
    if kind in INTEGERS:
        return _wrapped(_integer(rng, int(number)), kind), None
    if kind in REALS:
        value = _real(rng, float(number))
        return (_float32(value) if kind == T.FLOAT32 else value), None
    if kind == T.BOOL:
        return rng.random() < 0.5, None
    if kind == T.STRING:
        return rng.choice(
            ["", "x", str(original), "linear", "yarn", "none", "llama", "a\nb", "9" * 30]
        ), None
    item = rng.choice([T.UINT32, T.INT32, T.FLOAT32, T.STRING])
    return [_value_of(rng, item, original)[0] for _ in range(rng.choice([0, 1, 2, 4]))], item


def _scalar(raw: RawGGUF, key: str) -> object:
    """A field's value where it is a number (else a stand-in: 7)."""
    kind, data = raw.fields[key]
    if T(kind) in SCALAR_FORMATS:
        return struct.unpack("<" + SCALAR_FORMATS[T(kind)], data)[0]
    return 7


def _field_mutation(rng: random.Random, raw: RawGGUF) -> dict:
    """A field dropped, or set: one of the file's, or one the loaders read that it lacks; to a
    value of its own type or, one time in four, of another."""
    choice = rng.random()
    if choice < 0.12:
        return {"op": "drop", "key": rng.choice([*raw.fields, *LONG_ARRAYS])}
    if choice < 0.3:
        key = rng.choice(list(ADDED_KEYS))
        kind, original = ADDED_KEYS[key]
    else:
        key = rng.choice([k for k in raw.fields if k not in LONG_ARRAYS])
        kind, original = T(raw.fields[key][0]), _scalar(raw, key)
    if rng.random() < 0.25:
        kind = rng.choice([k for k in T if k != kind])
    value, item = _value_of(rng, kind, original)
    return {
        "op": "set",
        "key": key,
        "type": int(kind),
        "value": value,
        "item": None if item is None else int(item),
    }


def _tensor_mutation(rng: random.Random, raw: RawGGUF) -> dict:
    """One tensor's dimensions changed: one of them, their order or their number."""
    tensor = rng.choice(raw.tensors)
    dims = list(tensor.dims)
    where = rng.randrange(len(dims))
    dims[where] = rng.choice(
        [
            0,
            1,
            32,
            dims[where] + 32,
            dims[where] - 32,
            dims[where] * 2,
            dims[where] // 2,
            2**32,
            2**40,
            2**63,
        ]
    )
    if rng.random() < 0.2:
        dims = rng.choice([list(tensor.dims)[::-1], [*tensor.dims, 1], [*dims, 2], dims[:1]])
    return {"op": "dims", "tensor": tensor.name, "dims": [max(d, 0) for d in dims]}


def draw_mutations(seed: int, count: int) -> list[dict]:
    """``count`` files: each a base (its index in BASES) and one to three mutations, two in
    three of them to the metadata."""
    rng = random.Random(seed)
    bases = [RawGGUF.read(path) for path in BASES]
    files = []
    for _ in range(count):
        base = 0 if rng.random() < 0.75 else 1
        raw = bases[base]
        mutations = [
            _field_mutation(rng, raw) if rng.random() < 0.67 else _tensor_mutation(rng, raw)
            for _ in range(rng.choice([1, 1, 1, 2, 3]))
        ]
        files.append({"base": base, "mutations": mutations})
    return files


def apply(raw: RawGGUF, mutations: list[dict]) -> RawGGUF:
    """A copy of ``raw`` with ``mutations`` (``draw_mutations``' lists) made."""
    raw = raw.copy()
    for change in mutations:
        if change["op"] == "drop":
            raw.fields.pop(change["key"], None)
        elif change["op"] == "set":
            item = None if change["item"] is None else T(change["item"])
            raw.set(change["key"], T(change["type"]), change["value"], item)
        else:
            raw.reshape(change["tensor"], tuple(change["dims"]))
    return raw


# ------------------------------------------------------------ judging, in a process of its own


def peak_rss() -> int:
    """This process's peak resident set, in bytes: Linux's high-water mark of its memory
    since it exec'd (not ``ru_maxrss``, which counts the forking parent's pages too)."""
    status = Path("/proc/self/status").read_text()
    return (
        int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])
        * 1024
    )


def verdict(call, *refusals: type[BaseException]) -> list:
    """["ok", None], ["refused", its line] where ``call`` raises one of ``refusals``, or
    ["crash", the exception and where] for any other exception."""
    try:
        call()
    except refusals as error:
        return ["refused", str(error)]
    except Exception as error:  # what the test exists to find
        return ["crash", f"{type(error).__name__}: {error} at {traceback.format_exc(limit=-1)}"]
    return ["ok", None]


class Parties:
    """Each party's verdict on a file, as each judges it in the daemon and its workers, next
    to a target's GGUF the draft ``draft`` serves with."""

    def __init__(self, draft: Path) -> None:
        from hetspec.workers.tools.describe import _gguf_vocab  # noqa: PLC0415

        self.draft = draft
        self.draft_vocab = _gguf_vocab(draft).vocab

    def judge(self, path: Path) -> dict:
        from hetspec.daemon.config import DaemonConfig, ModelPaths  # noqa: PLC0415
        from hetspec.daemon.load.model_check import CannotServe, CheckError, Side, find_exports  # noqa: PLC0415
        from hetspec.daemon.supervision.supervisor import StartupError, check_model_files  # noqa: PLC0415
        from hetspec.native.model import ModelFormatError, NativeModel  # noqa: PLC0415
        from hetspec.protocol.gguf_checks import GGUFMetadataError, check_model_file  # noqa: PLC0415
        from hetspec.protocol.gguf_header import GGUFFormatError  # noqa: PLC0415
        from hetspec.speculative.drafting.vocab_match import incompatibilities  # noqa: PLC0415
        from hetspec.workers.runtimes.llama_cpp_runtime.runtime import (  # noqa: PLC0415
            LlamaCppError,
            LlamaCppRuntime,
        )
        from hetspec.workers.tools.describe import _gguf_vocab  # noqa: PLC0415

        verdicts: dict[str, object] = {}
        verdicts["check"] = verdict(
            lambda: check_model_file(path), GGUFMetadataError, GGUFFormatError
        )
        config = DaemonConfig(
            target=ModelPaths(gguf=str(path)), draft=ModelPaths(gguf=str(self.draft))
        )

        def llama_cpp() -> None:  # the worker that verifies on the GGUF, as the daemon starts it
            runtime = LlamaCppRuntime(path, threads=1, n_seq_max=2)
            try:
                problems = incompatibilities(self.draft_vocab, runtime.vocab_info())
            finally:
                runtime.close()
            if problems:  # the supervisor's refusal
                raise StartupError(f"do not share a tokenizer: {'; '.join(problems)}")

        def daemon() -> None:
            check_model_files(config)
            llama_cpp()

        verdicts["llama_cpp"] = verdict(llama_cpp, LlamaCppError, StartupError)
        verdicts["daemon"] = verdict(daemon, StartupError, LlamaCppError)
        native_side: list = []

        def models_check() -> None:  # find_exports, then the vocabulary as describe reads it
            model = find_exports("target", path)
            native_side.append(Side("verifies", "GPU worker", "native", model).unusable())
            report = _gguf_vocab(path)
            if report.error:
                raise CheckError(report.error)
            if problems := incompatibilities(self.draft_vocab, report.vocab):
                raise CheckError(f"vocabulary: NOT shared: {'; '.join(problems)}")

        verdicts["models_check"] = verdict(models_check, CheckError, CannotServe)
        verdicts["models_check_native"] = native_side[0] if native_side else None
        verdicts["native"] = verdict(lambda: NativeModel(path), ModelFormatError)
        return verdicts


def main(argv: list[str]) -> int:
    files = json.loads(Path(argv[0]).read_text())
    folder = Path(argv[1]).parent / "files"
    folder.mkdir(exist_ok=True)
    bases = [RawGGUF.read(path) for path in BASES]
    parties = Parties(BASES[0])
    with open(argv[1], "w") as out:
        for index, spec in enumerate(files):
            path = apply(bases[spec["base"]], spec["mutations"]).write(folder / f"{index}.gguf")
            print(json.dumps({"index": index, "started": True}), file=out, flush=True)
            record = {"index": index, "size": path.stat().st_size, **parties.judge(path)}
            print(json.dumps(record), file=out, flush=True)
            path.unlink()
        print(json.dumps({"peak_rss": peak_rss()}), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

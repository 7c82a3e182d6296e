"""The systems hetspec is compared with, on the same models, counted as it counts.

    python -m hetspec.bench.peers [--threads N] [--target-gguf F] [--draft-gguf F]
        [--target-folder D] [--draft-folder D] [--llama-server PATH|build|off]

``hetspec bench`` runs this as a process of its own (the client never imports torch or
llama.cpp) and interleaves its requests with hetspec's, so that a box whose speed drifts (a
shared VM's did by up to 2x within an hour) slows every system alike. It loads the peers and
writes ``{"systems": [...], "skipped": {name: why}, "llama_server": {...}}`` as its first line
(a peer that cannot be had is skipped with one line why, the others go on), then answers one
JSON request per line (``{"system", "prompt", "max_tokens"}``, and ``"seed"`` where sampled)
with ``{"ttft_ms", "decode_ms", "tokens"}`` (llama-server's also ``draft_n`` and
``draft_n_accepted``), or ``{"error"}``. Exactly ``max_tokens`` tokens (EOS ignored), greedy,
or with ``--temperature`` T > 0 drawn from the softmax at T alone (no top-k, top-p or min-p,
as hetspec's bench requests), all of the process's cores for each system:

- ``transformers assisted``: Hugging Face transformers' assisted generation,
  ``target.generate(assistant_model=draft)`` on the model folders, the peer most users would
  reach for;
- ``llama-cpp-python loop speculative gamma=4``: both GGUF models in llama.cpp in one process,
  draft gamma tokens then verify them in one batch, a plain loop written here over this
  package's llama.cpp runtime (the library calls hetspec makes, none of its processes); not
  llama.cpp's own implementation; greedy only (skipped at a temperature);
- ``llama-server target alone``, ``llama-server speculative (default n-max)`` and
  ``llama-server speculative n-max=N``: llama.cpp's own server (built from the llama.cpp that
  llama-cpp-python vendors, see native/build-llama-server.sh) on the target GGUF alone, and
  with the draft GGUF (``--spec-type draft-simple``) at its default draft length and at the
  best one of a sweep at startup (draft lengths 1, 2, 3, 4, 6, 8; decode tokens/s on two
  prompts of its own, none of the bench's; see ``llama_server_peers.sweep_n_max``).

Decode time is the time after the first token (which comes with the prefill in every system)
and covers the other max_tokens - 1 tokens.

The peers themselves live in ``library_peers`` (transformers, the llama-cpp-python loop) and
``llama_server_peers`` (llama-server's processes, sweeps and rows); this module is the
process: which peers can be had here, and the request loop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TextIO

from hetspec.bench.library_peers import (
    WARMUP_PROMPT,
    LlamaCppSpeculative,
    Peer,
    TransformersAssisted,
)
from hetspec.bench.llama_server import LlamaServerError, LlamaServerUnavailable, find_llama_server
from hetspec.bench.llama_server_peers import ServerPool, llama_server_peers, servers_that_fit

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGET_GGUF = MODELS / "target" / "target-q8_0.gguf"
DRAFT_GGUF = MODELS / "draft" / "draft-q8_0.gguf"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False where torch is missing)."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    return torch.cuda.is_available()


def llama_cpp_offloads() -> bool:
    """Whether the installed llama-cpp-python sees a GPU of this machine (its own
    ``llama_supports_gpu_offload`` also says yes for a CPU build with the RPC backend)."""
    try:
        from hetspec.workers.runtimes.llama_cpp_runtime.ggml import local_gpu_present  # noqa: PLC0415
    except ImportError:
        return False
    return local_gpu_present()


def assisted_peer(
    args: argparse.Namespace, gpu: bool, skipped: dict[str, str]
) -> list[tuple[str, Callable[[], Peer]]]:
    """transformers' assisted generation, where the pair has model folders."""
    name = "transformers assisted"
    if not (args.target_folder and args.draft_folder):
        skipped[name] = "it loads model folders, and the pair is given as GGUF files only"
        return []
    return [
        (
            name,
            lambda: TransformersAssisted(
                args.threads,
                args.target_folder,
                args.draft_folder,
                gpu=gpu,
                temperature=args.temperature,
            ),
        )
    ]


def load_peers(
    args: argparse.Namespace, stack: ExitStack, skipped: dict[str, str], info: dict
) -> list[Peer]:
    """Every peer that can be had, warmed up; the others go to ``skipped`` with one line why.
    With ``args.gpu`` ("auto": where torch sees CUDA) the peers compute on the GPU."""
    gpu = cuda_available() if args.gpu == "auto" else args.gpu == "on"
    candidates = assisted_peer(args, gpu, skipped)
    loop = "llama-cpp-python loop speculative gamma=4"
    if args.temperature > 0:
        skipped[loop] = "greedy only (it verifies by the target's argmax)"
    elif gpu and not llama_cpp_offloads():
        skipped[loop] = "the installed llama-cpp-python cannot offload to the GPU (a CPU build)"
    else:
        candidates.insert(
            0,
            (
                loop,
                lambda: LlamaCppSpeculative(
                    args.threads, args.target_gguf, args.draft_gguf, gpu_layers=-1 if gpu else 0
                ),
            ),
        )
    if args.llama_server == "off":
        skipped["llama-server"] = "turned off (--llama-server off)"
    else:
        try:
            if args.llama_server == "build":
                binary = find_llama_server(build=True, backend="cuda" if gpu else "cpu")
            else:
                binary = Path(args.llama_server).expanduser()
                if not (binary.is_file() and os.access(binary, os.X_OK)):
                    raise LlamaServerUnavailable(f"{binary} is not an executable file")
            models = [args.target_gguf, args.draft_gguf]
            pool = ServerPool(binary, servers_that_fit(models, 3))
            stack.callback(pool.close)
            peers = llama_server_peers(
                pool,
                args.threads,
                *models,
                skipped=skipped,
                info=info,
                gpu=gpu,
                temperature=args.temperature,
            )
            candidates += [(peer.name, lambda peer=peer: peer) for peer in peers]
        except (LlamaServerUnavailable, LlamaServerError) as error:
            skipped["llama-server"] = str(error)
    loaded = []
    for name, make in candidates:
        try:
            peer = make()
            peer.run(WARMUP_PROMPT, 8, 0)
        except Exception as error:  # a peer that fails is reported, not fatal to the others
            said = str(error).strip().splitlines()
            skipped[name] = f"{type(error).__name__}: {said[0] if said else ''}"[:300]
            print(f"peers: skipping {name}: {skipped[name]}", file=sys.stderr)
            continue
        loaded.append(peer)
    return loaded


def serve(args: argparse.Namespace, requests: TextIO, replies: TextIO) -> None:
    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    skipped: dict[str, str] = {}
    info: dict = {}
    with ExitStack() as stack:
        peers = {peer.name: peer for peer in load_peers(args, stack, skipped, info)}
        reply({"systems": list(peers), "skipped": skipped, "llama_server": info})
        for line in requests:
            try:
                request = json.loads(line)
                peer = peers[request["system"]]
                result = peer.run(request["prompt"], request["max_tokens"], request.get("seed"))
            except (ValueError, KeyError, TypeError, LlamaServerError) as error:
                reply({"error": f"bad request {line.strip()[:200]!r}: {error!r}"})
                continue
            reply({**result, "tokens": request["max_tokens"]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--target-gguf",
        type=Path,
        default=TARGET_GGUF,
        help="the target for llama.cpp (default: the bundled one)",
    )
    parser.add_argument(
        "--draft-gguf",
        type=Path,
        default=DRAFT_GGUF,
        help="the draft for llama.cpp (default: the bundled one)",
    )
    parser.add_argument(
        "--target-folder",
        type=str,
        default=str(MODELS / "target"),
        help="the target for transformers (default: the bundled one)",
    )
    parser.add_argument(
        "--draft-folder",
        type=str,
        default=str(MODELS / "draft"),
        help="the draft for transformers (default: the bundled one)",
    )
    parser.add_argument(
        "--llama-server",
        default="build",
        help="llama.cpp's own server: a path to the binary, 'build' (the cached build, made "
        "on first use by native/build-llama-server.sh; the default) or 'off'",
    )
    parser.add_argument(
        "--gpu",
        choices=["auto", "on", "off"],
        default="auto",
        help="peers on the GPU: llama-server's CUDA build with every layer "
        "offloaded, transformers on CUDA in bf16 (default auto: where torch "
        "sees CUDA)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample every system at this temperature (default 0: greedy)",
    )
    args = parser.parse_args(argv)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature must be a finite number >= 0, not {args.temperature}")
    try:
        serve(args, sys.stdin, sys.stdout)
    except BrokenPipeError:  # the bench that asked is gone: nothing left to answer
        sys.stdout = None  # (interpreter exit would flush to the closed pipe again)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

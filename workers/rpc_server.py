"""``hetspec-rpc-server``: serve this machine's CPU to a hetspec verifier on another host.

It is llama.cpp's rpc-server, run from the llama.cpp that hetspec's workers link (so its RPC
protocol always matches theirs). It binds the loopback interface unless told otherwise: the
protocol has no authentication and no encryption, so reach it through an SSH tunnel or a
private link (docs/beyond-one-box.md), never an open network.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from hetspec.endpoints import is_loopback, parse_rpc_endpoint

WARNING = (
    "WARNING: serving on {host}, not the loopback interface. llama.cpp's RPC protocol has no "
    "authentication and no encryption: anyone who reaches this port can run code paths of "
    "this process and read what it computes. Only ever expose it on a private link."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetspec-rpc-server", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50052, help="TCP port (default 50052)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: every core this process may use)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="keep received weights here, so a restarted client loads faster",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="bind a non-loopback address (read the warning it prints)",
    )
    args = parser.parse_args(argv)
    try:
        parse_rpc_endpoint(f"{args.host}:{args.port}")
    except ValueError as error:
        parser.error(f"--host/--port: {error}")
    if not is_loopback(args.host) and not args.allow_remote:
        parser.error(
            f"--host {args.host} is not a loopback address: llama.cpp's RPC protocol "
            "is unauthenticated; add --allow-remote only on a private link"
        )
    owned = len(os.sched_getaffinity(0))
    threads = args.threads or owned
    if not 0 < threads <= owned:
        parser.error(f"--threads must be in 1..{owned} (the cores this process may use)")
    if not is_loopback(args.host):
        print(WARNING.format(host=args.host), file=sys.stderr)

    from hetspec.workers.runtimes.llama_cpp_runtime.rpc import RpcError, serve  # noqa: PLC0415

    # The server loop runs inside llama.cpp, where Python's handlers never run: let the
    # signals end the process directly (it keeps no state worth a clean shutdown).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    endpoint = f"{args.host}:{args.port}"
    print(
        f"hetspec-rpc-server: serving {threads} CPU threads at {endpoint}",
        file=sys.stderr,
        flush=True,
    )
    try:
        serve(endpoint, threads, args.cache_dir)
    except RpcError as error:
        print(f"hetspec-rpc-server: {error}", file=sys.stderr)
        return 1
    print(f"hetspec-rpc-server: could not serve at {endpoint} (in use? see above)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

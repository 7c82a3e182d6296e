"""Command line of ``hetspec``, the shell client of hetspecd."""

from __future__ import annotations

import argparse
import os
import sys

from hetspec import __version__
from hetspec.client import bench as bench_module
from hetspec.client.connection import DEFAULT_SOCKET, Client, ClientError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetspec",
        description=(
            "Shell client of hetspecd, the heterogeneous CPU/GPU speculative decoding daemon. "
            "It talks to a running daemon over its Unix socket."
        ),
        epilog="Check the box the daemon runs on with `hetspecd --check`.",
    )
    parser.add_argument("--version", action="version", version=f"hetspec {__version__}")
    parser.add_argument(
        "--socket",
        default=os.environ.get("HETSPEC_SOCKET", str(DEFAULT_SOCKET)),
        help="the daemon's socket (default $HETSPEC_SOCKET or %(default)s)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    health = commands.add_parser("health", help="is the daemon ready? (exit 0 when it is)")
    health.add_argument(
        "--wait",
        type=float,
        default=0,
        metavar="SECONDS",
        help="wait up to this long for the workers to be ready",
    )
    bench = commands.add_parser(
        "bench",
        help="compare the decoding modes (starts its own hetspecd on the bundled models)",
        description=bench_module.__doc__.split("\n\n")[0],
    )
    bench_module.add_arguments(bench)
    bench.add_argument(
        "--running",
        action="store_true",
        help="bench the daemon at --socket instead of starting one (its placement only)",
    )
    generate = commands.add_parser("generate", help="stream a completion of PROMPT")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end the answer before TEXT (repeatable)",
    )
    generate.add_argument(
        "--mode",
        choices=["adaptive", "parallel", "sequential", "autoregressive"],
        help="how to decode (default: the daemon's configured mode, normally adaptive)",
    )
    generate.add_argument(
        "--gamma", type=int, help="fixed draft length (modes parallel and sequential)"
    )
    generate.add_argument("--quiet", action="store_true", help="no statistics on stderr")
    return parser


def statistics_line(final: dict) -> str:
    t = final.get("timings", {})
    devices = final.get("devices", {})
    line = (
        f"[{final.get('mode')}: {t.get('predicted_n')} tokens in "
        f"{t.get('predicted_ms', 0):.0f} ms, {t.get('predicted_per_second')} tokens/s; "
        f"prompt {t.get('prompt_n')} tokens in {t.get('prompt_ms', 0):.0f} ms, "
        f"first token after {t.get('ttft_ms') or 0:.0f} ms; "
        f"stop: {final.get('done_reason')}; target on {devices.get('target')}, "
        f"draft on {devices.get('draft')}"
    )
    speculative = final.get("speculative")
    if speculative:
        gammas = speculative.get("gamma_history") or [0]
        line += (
            f"; {speculative['rounds']} rounds, {t.get('draft_n_accepted')}/"
            f"{t.get('draft_n')} drafted tokens accepted, mean accepted length "
            f"{speculative['mean_accepted_length']}, gamma {min(gammas)}..{max(gammas)}"
        )
    return line + "]"


def run_generate(client: Client, args: argparse.Namespace) -> int:
    options = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
        "mode": args.mode,
        "gamma": args.gamma,
    }
    final: dict = {}
    for message in client.generate(args.prompt, **options):
        if message.get("done"):
            final = message
        else:
            sys.stdout.write(message["response"])
            sys.stdout.flush()
    sys.stdout.write("\n")
    if final.get("done_reason") == "error":
        print(f"hetspec: generation failed: {final.get('error')}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(statistics_line(final), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        args.argv = sys.argv[2:] if argv is None else argv[1:]
        args.socket = args.socket if args.running else None
        return bench_module.main(args)
    client = Client(args.socket)
    try:
        if args.command == "health":
            body = client.wait_ready(args.wait) if args.wait else client.health()[1]
            print(body.get("status"))
            return 0 if body.get("status") == "ready" else 1
        return run_generate(client, args)
    except ClientError as error:
        print(f"hetspec: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

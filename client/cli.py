"""Command line of ``hetspec``, the shell client of hetspecd."""

from __future__ import annotations

import argparse
import sys

from hetspec import __version__


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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    # No command is available yet: say so plainly instead of pretending.
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

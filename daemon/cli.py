"""Command line of ``hetspecd``."""

from __future__ import annotations

import argparse
import platform
import sys

import msgspec

from hetspec import __version__
from hetspec.daemon.runtime_check import check_runtimes, describe
from hetspec.logs import LOG_LEVELS, configure_logging, get_logger
from hetspec.protocol import ProbeFailure


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetspecd",
        description=(
            "The hetspec daemon: speculative decoding across the CPU (llama.cpp) and the GPU "
            "(torch) of one box. It supervises a CPU worker and a GPU worker process; one "
            "drafts, the other verifies, and only verified tokens are ever returned."
        ),
        epilog="Logs go to stderr: JSON lines when not on a terminal (journald), text on one.",
    )
    parser.add_argument("--version", action="version", version=f"hetspecd {__version__}")
    parser.add_argument(
        "--check",
        action="store_true",
        help="describe the llama.cpp and torch runtimes the workers would use on this box "
        "(devices, cores, CPU features of the llama.cpp build) and exit; non-zero if one "
        "cannot load",
    )
    parser.add_argument(
        "--json", action="store_true", help="with --check: print the reports as JSON"
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    return parser


def run_check(as_json: bool) -> int:
    reports = check_runtimes()
    if as_json:
        document = {"hetspecd": __version__, "runtimes": reports}
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(document)) + b"\n")
    else:
        print(
            f"hetspecd {__version__} on {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}"
        )
        for report in reports.values():
            print("\n".join(describe(report)))
    return 1 if any(isinstance(r, ProbeFailure) for r in reports.values()) else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format, process="hetspecd")
    if args.check:
        return run_check(args.json)
    get_logger(__name__).error(
        "serving is not available in this version yet; `hetspecd --check` reports the runtimes",
        version=__version__,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())

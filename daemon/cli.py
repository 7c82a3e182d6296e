"""Command line of ``hetspecd``."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import msgspec
import uvloop

from hetspec import __version__
from hetspec.daemon.config import (
    DEFAULT_CONFIG_FILE,
    ConfigError,
    DaemonConfig,
    cache_dir,
    load_config,
    model_paths_of,
    parse_value,
)
from hetspec.daemon.load.runtime_check import check_runtimes, describe
from hetspec.daemon.load.runtime_trials import (
    RuntimeChoiceError,
    decide_drafter,
    decide_gpu_runtime,
)
from hetspec.daemon.service import Service
from hetspec.daemon.supervision.cores import CoreError
from hetspec.daemon.supervision.supervisor import StartupError
from hetspec.logs import LOG_LEVELS, configure_logging, get_logger
from hetspec.protocol import ProbeFailure
from hetspec.speculative.control.arca import cache_path, describe_cached, split_gpu


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
        "(devices, cores, CPU features of the llama.cpp build), and which runtime the GPU "
        'worker would use with this configuration (gpu_runtime "auto" measures each, as the '
        "daemon does at load, and caches the figures), then exit; non-zero if one cannot load",
    )
    parser.add_argument(
        "--json", action="store_true", help="with --check: print the reports as JSON"
    )
    parser.add_argument(
        "--config",
        type=Path,
        help=f"TOML file (default {DEFAULT_CONFIG_FILE}, "
        "or $HETSPEC_CONFIG; a missing default file is fine)",
    )
    parser.add_argument("--socket", help="Unix socket to serve HTTP on")
    parser.add_argument("--runtime-dir", help="directory for the lock and worker endpoints")
    parser.add_argument("--placement", choices=("draft-cpu", "draft-gpu"))
    parser.add_argument(
        "--target",
        metavar="PATH",
        help="the target model: a .gguf file, a "
        "model folder, or a folder holding both (sets target.folder and "
        "target.gguf; a missing export is left empty)",
    )
    parser.add_argument("--draft", metavar="PATH", help="the draft model, likewise")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting, e.g. --set cpu_worker.n_batch=256 (repeatable). The command "
        "line is visible to every user of the box (ps): never pass a secret such as "
        "tcp.token here; use tcp.token_file (a file only hetspecd's user can read)",
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS)
    parser.add_argument("--log-format", choices=("auto", "json", "console"))
    return parser


def overrides_from(args: argparse.Namespace) -> dict[str, object]:
    overrides: dict[str, object] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = parse_value(value.strip())
    named = {
        "socket": args.socket,
        "runtime_dir": args.runtime_dir,
        "placement": args.placement,
        "log_level": args.log_level,
        "log_format": args.log_format,
    }
    overrides.update({key: value for key, value in named.items() if value is not None})
    for name in ("target", "draft"):
        if (path := getattr(args, name, None)) is not None:
            exports = model_paths_of(path)
            overrides[f"{name}.folder"], overrides[f"{name}.gguf"] = exports.folder, exports.gguf
    return overrides


async def decide_runtimes(config: DaemonConfig):
    """The drafter's and the GPU worker's runtimes, decided as the daemon decides them."""
    cache = cache_dir(config.cache_dir)
    drafter = await decide_drafter(config, "console", cache)
    return drafter, await decide_gpu_runtime(config, "console", cache, drafter)


def split_summary(config: DaemonConfig) -> str:
    """What ``gpu_worker.split_ratio`` will do (HCMP), for ``--check``."""
    ratio = config.gpu_worker.split_ratio
    if config.placement != "draft-cpu":
        return f"split_ratio {ratio}: ignored, the GPU worker drafts in {config.placement}"
    if config.gpu_runtime not in ("torch", "auto"):
        return f"split_ratio {ratio}: applies where the GPU worker runs torch only"
    if ratio != "auto":
        return f"HCMP split, GPU share {ratio:g} (or one line in the device words why not)"
    gpu = split_gpu(config.gpu_worker.device)
    path = cache_path(cache_dir(config.cache_dir), Path(config.target.folder), gpu)
    return f"HCMP auto: {describe_cached(path)}"


def run_check(as_json: bool, config: DaemonConfig | None) -> int:
    """Describe the runtimes; with a configuration, also decide the GPU worker's runtime as
    the daemon would (measuring for "auto", or reading the cached profiles)."""
    reports = check_runtimes()
    failed = any(isinstance(r, ProbeFailure) for r in reports.values())
    decision, drafter, problem = None, None, None
    if config is not None and not failed:
        try:
            drafter, decision = uvloop.run(decide_runtimes(config))
        except (RuntimeChoiceError, CoreError, StartupError, ValueError) as error:
            problem = str(error)
    if as_json:
        document = {
            "hetspecd": __version__,
            "runtimes": reports,
            "gpu_runtime": decision,
            "drafter": drafter,
            "gpu_runtime_error": problem,
        }
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(document)) + b"\n")
    else:
        print(
            f"hetspecd {__version__} on {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}"
        )
        for report in reports.values():
            print("\n".join(describe(report)))
        if drafter is not None:
            print(f"{config.placement}: {drafter.summary()}")
        if decision is not None:
            print(f"{config.placement}: {decision.summary()}")
        if config is not None and config.gpu_worker.split_ratio is not None:
            print(f"{config.placement}: {split_summary(config)}")
        if problem is not None:
            print(f"ERROR choosing the GPU worker's runtime: {problem}")
    return 1 if failed or problem else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config, overrides_from(args))
    except ConfigError as error:
        print(f"hetspecd: bad configuration: {error}", file=sys.stderr)
        return 2
    if args.check:
        configure_logging(args.log_level or "info", args.log_format or "auto", process="hetspecd")
        return run_check(args.json, config)
    configure_logging(config.log_level, config.log_format, process="hetspecd")
    worker_log_format = (
        "json"
        if config.log_format == "auto" and not sys.stderr.isatty()
        else ("console" if config.log_format == "auto" else config.log_format)
    )
    get_logger(__name__).info("starting", version=__version__, pid=os.getpid())
    return uvloop.run(Service(config, worker_log_format).run())


if __name__ == "__main__":
    sys.exit(main())

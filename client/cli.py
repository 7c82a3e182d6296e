"""Command line of ``hetspec``, the shell client of hetspecd."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from hetspec import __version__
from hetspec.arguments import finite_float
from hetspec.bench import compare as bench_module
from hetspec.client.clients import Client
from hetspec.client.types import DEFAULT_SOCKET, Completion, HetspecError, QueueFull
from hetspec.protocol.modes import MODES


def _add_generation_options(parser: argparse.ArgumentParser, max_tokens: int | None) -> None:
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help="most tokens to generate (default %(default)s)",
    )
    parser.add_argument("--temperature", type=finite_float, help="0 = greedy (the default for run)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=finite_float)
    parser.add_argument("--seed", type=int, help="the same seed, the same sampled text (any mode)")
    parser.add_argument(
        "--stop", action="append", metavar="TEXT", help="end the answer before TEXT (repeatable)"
    )
    parser.add_argument(
        "--mode", choices=MODES, help="how to decode (default: the daemon's, normally adaptive)"
    )
    parser.add_argument("--gamma", type=int, help="fixed draft length (parallel, sequential)")
    parser.add_argument("--quiet", action="store_true", help="no summary line on stderr")


def _add_connection_options(parser: argparse.ArgumentParser, socket, flag) -> None:
    parser.add_argument(
        "--host",
        default=None if socket is not argparse.SUPPRESS else socket,
        help="unix:///path or http://host:port (default $HETSPEC_HOST, else "
        f"unix://{DEFAULT_SOCKET}); a TCP daemon needs $HETSPEC_TOKEN",
    )
    parser.add_argument(
        "--socket", default=socket, help="the daemon's Unix socket (same as --host unix://PATH)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=flag,
        help="machine-readable output: one JSON document per answer (chat: one line per "
        'turn), or {"error": ...} when the daemon cannot answer',
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetspec",
        description=(
            "Shell client of hetspecd, the heterogeneous CPU/GPU speculative decoding daemon. "
            "It talks to a running daemon over its Unix socket (or TCP)."
        ),
        epilog="Check the box the daemon runs on with `hetspecd --check`.",
    )
    parser.add_argument("--version", action="version", version=f"hetspec {__version__}")
    _add_connection_options(parser, os.environ.get("HETSPEC_SOCKET"), False)
    # the same options after the subcommand (`hetspec run "..." --host ...`); there a default
    # is SUPPRESS, so that one given before the subcommand is not overwritten
    after = argparse.ArgumentParser(add_help=False)
    _add_connection_options(after, argparse.SUPPRESS, argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        aliases=["generate"],
        parents=[after],
        help="stream a completion of PROMPT, then a summary line",
    )
    run.add_argument("prompt", help="the text to continue; - reads it from standard input")
    _add_generation_options(run, 128)
    chat = commands.add_parser(
        "chat", parents=[after], help="an interactive chat (the model's chat template; /help)"
    )
    chat.add_argument("--system", help="a system message to start the chat with")
    _add_generation_options(chat, 512)
    commands.add_parser(
        "status", parents=[after], help="models, devices, placement, queue and live gamma"
    )
    health = commands.add_parser(
        "health", parents=[after], help="is the daemon ready? (exit 0 when it is)"
    )
    health.add_argument(
        "--wait",
        type=float,
        default=0,
        metavar="SECONDS",
        help="wait up to this long for the workers to be ready",
    )
    models = commands.add_parser(
        "models", help="check model files before serving them: hetspec models check TARGET [DRAFT]"
    )
    models.add_argument("action", choices=["check"])
    models.add_argument(
        "arguments",
        nargs=argparse.REMAINDER,
        help="TARGET [DRAFT] (see hetspec models check --help)",
    )
    bench = commands.add_parser(
        "bench",
        help="compare the decoding modes (starts its own hetspecd on the bundled models)",
        description=bench_module.__doc__.split("\n\n")[0].replace("``", ""),
    )
    bench_module.add_arguments(bench)
    bench.add_argument(
        "--running",
        action="store_true",
        help="bench the daemon at --host instead of starting one (its placement only)",
    )
    bench.add_argument(
        "--clients",
        metavar="N,N,...",
        help="instead of the modes: N clients at once against hetspecd (max_parallel N, and "
        "one at a time) and llama-server -np N, a bench with options of its own (hetspec "
        "bench --clients 1 --help)",
    )
    return parser


def _clients_bench_arguments(argv: list[str]) -> list[str] | None:
    """The arguments after ``bench`` when the command line is ``hetspec bench ... --clients
    ...``: the clients bench (``hetspec.bench.parallel_clients``), which parses them itself; else
    None."""
    if argv[:1] != ["bench"]:
        return None
    rest = argv[1:]
    return rest if any(a == "--clients" or a.startswith("--clients=") for a in rest) else None


def _options(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
        "mode": args.mode,
        "gamma": args.gamma,
    }


def summary_line(done: Completion) -> str:
    """One line: speed, accepted tokens per round, gamma."""
    t = done.timings
    line = (
        f"[{done.mode}: {t.get('predicted_n')} tokens, {t.get('predicted_per_second')} "
        f"tokens/s, first token after {t.get('ttft_ms') or 0:.0f} ms; "
        f"stop: {done.done_reason}"
    )
    speculative = done.speculative
    if speculative:
        gammas = speculative.get("gamma_history") or [0]
        line += (
            f"; {speculative['mean_accepted_length']} accepted per round over "
            f"{speculative['rounds']} rounds ({t.get('draft_n_accepted')}/"
            f"{t.get('draft_n')} drafted), gamma {min(gammas)}..{max(gammas)}"
        )
    devices = done.devices
    if devices:
        line += f"; target on {devices.get('target')}, draft on {devices.get('draft')}"
    return line + "]"


def _as_json(done: Completion) -> str:
    return json.dumps(
        {
            "response": done.text,
            "done_reason": done.done_reason,
            "id": done.id,
            "mode": done.mode,
            "tokens": done.tokens,
            "timings": done.timings,
            "speculative": done.speculative,
            "devices": done.devices,
        }
    )


def run_generate(client: Client, args: argparse.Namespace) -> int:
    if args.temperature is None:
        args.temperature = 0.0  # a shell prompt gets the target's own greedy answer
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    if args.json:
        print(_as_json(client.generate(args.prompt, **_options(args))))
        return 0
    with client.stream(args.prompt, **_options(args)) as answer:
        for piece in answer:
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    if not args.quiet and answer.completion is not None:
        print(summary_line(answer.completion), file=sys.stderr)
    return 0


CHAT_HELP = """\
/help         this list
/clear        forget the conversation (the system message stays)
/exit, /quit  leave (so does Ctrl-D)
Ctrl-C stops the answer being written and keeps the chat."""


def _chat_command(text: str, messages: list[dict], system: str | None) -> bool | None:
    """Run a /command: True to leave the chat, False when done, None: not a command."""
    command = text.strip()
    if command in ("/exit", "/quit"):
        return True
    if command in ("/help", "/?"):
        print(CHAT_HELP, flush=True)
        return False
    if command == "/clear":
        messages[:] = [{"role": "system", "content": system}] if system else []
        print("(the conversation is forgotten)", flush=True)
        return False
    if command.startswith("/") and " " not in command:
        print(f"unknown command {command}: /help lists them", flush=True)
        return False
    return None


def _streamed_reply(client: Client, messages: list[dict], args, interactive: bool) -> str:
    """Stream the answer to ``messages``; Ctrl-C stops it (the connection closes, so the
    daemon cancels it) and what was written stays the assistant's turn."""
    if interactive:
        print("assistant> ", end="", flush=True)
    written = []
    try:
        with client.chat_stream(messages, **_options(args)) as answer:
            for piece in answer:
                written.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write(" [stopped]\n")
        sys.stdout.flush()
        return "".join(written)
    sys.stdout.write("\n")
    done = answer.completion
    if done is not None and not args.quiet:
        print(summary_line(done), file=sys.stderr)
    return done.text if done else "".join(written)


def run_chat(client: Client, args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("(/help lists the commands)", flush=True)
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:  # end of input
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        command = _chat_command(text, messages, args.system)
        if command is not None:
            if command:
                return 0
            continue
        messages.append({"role": "user", "content": text})
        if args.json:
            done = client.chat(messages, **_options(args))
            print(_as_json(done), flush=True)
            reply = done.text
        else:
            reply = _streamed_reply(client, messages, args, interactive)
        messages.append({"role": "assistant", "content": reply})


def run_health(client: Client, args: argparse.Namespace) -> int:
    health = client.wait_ready(args.wait) if args.wait else client.health()
    print(json.dumps(health) if args.json else health["status"])
    return 0 if health["status"] == "ready" else 1


def run_status(client: Client, args: argparse.Namespace) -> int:
    props = client.props()
    if args.json:
        print(json.dumps(props))
        return 0
    queue, devices = props["queue"], props["devices"]
    live = props["gamma"].get(props["mode"]) or {}
    print(f"hetspecd {props['version']}: {props['status']}, up {props['uptime_s']} s")
    print(
        f"model     {props['model']} (target {props['models']['target']['folder']}, "
        f"draft {props['models']['draft']['gguf']})"
    )
    print(
        f"placement {props['placement']}: target on {devices.get('target')}, "
        f"draft on {devices.get('draft')}"
    )
    print(
        f"mode      {props['mode']}; live gamma {live.get('gamma', '-')}, "
        f"branches {live.get('branches', '-')}, overlap {live.get('overlap', '-')}"
    )
    print(
        f"queue     {'1 running' if queue['running'] else 'idle'}, {queue['waiting']} "
        f"waiting of {queue['capacity']}, {queue['refused']} refused"
    )
    for name, worker in props["workers"].items():
        print(
            f"worker    {name}: pid {worker['pid']}, {worker['device']}, "
            f"restarts {worker['restarts']}"
        )
    return 0 if props["status"] == "ready" else 1


def _failed(args: argparse.Namespace, message: str) -> int:
    """Say why on stderr, and with --json as the one document on stdout too."""
    print(f"hetspec: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"error": message}), flush=True)
    return 1


def _without_a_client(args: argparse.Namespace, argv: list[str] | None, host: str | None) -> int:
    if args.command == "models":  # the daemon's own check, in a process of its own
        check = [sys.executable, "-m", "hetspec.daemon.load.model_check", *args.arguments]
        return subprocess.run(check, check=False).returncode
    if args.clients is not None:  # options before `bench` kept it from _clients_bench_arguments
        print("hetspec bench --clients: give no options before `bench`", file=sys.stderr)
        return 2
    args.argv = sys.argv[2:] if argv is None else argv[1:]
    if args.running and args.settings:
        print(
            "hetspec bench: --set applies to the daemons the bench starts, not to a running "
            "one (--running)",
            file=sys.stderr,
        )
        return 2
    args.socket = host if args.running else None
    return bench_module.main(args)


def main(argv: list[str] | None = None) -> int:
    clients = _clients_bench_arguments(sys.argv[1:] if argv is None else argv)
    if clients is not None:
        from hetspec.bench import parallel_clients as clients_bench  # noqa: PLC0415 - only for it

        return clients_bench.main(clients, prog="hetspec bench")
    return _run(argv)


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    host = args.host or (f"unix://{args.socket}" if args.socket else None)
    if args.command in ("bench", "models"):
        return _without_a_client(args, argv, host)
    try:
        client = Client(host)
    except ValueError as error:
        print(f"hetspec: {error}", file=sys.stderr)
        return 2
    commands = {"health": run_health, "status": run_status, "chat": run_chat}
    try:
        return commands.get(args.command, run_generate)(client, args)
    except QueueFull as error:
        return _failed(
            args, f"the daemon is busy: {error.message} (retry in {error.retry_after_s or 1:g} s)"
        )
    except HetspecError as error:
        return _failed(args, str(error))
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())

"""``python -m hetspec.bench.structured_output``: JSON under a schema, with and without speculation.

Six schemas of different shapes (nested objects, arrays, enums, bounded numbers, optional
fields), each asked for in a chat prompt. Systems, each given the schema: hetspecd on the
target and its draft model (adaptive: the controller's rounds, the grammar's forced tokens,
model-free drafts; autoregressive: the same requests without speculation), hetspecd on the
target alone (adaptive: forced tokens and model-free drafts only), llama-server alone and
with the same draft model (its ``json_schema`` field; draft length and p-min at the best of a
sweep on a schema prompt of its own, flash attention on/off for the target alone). Greedy
passes time the systems; one seeded pass at temperature 0.7 checks validity when sampling.
Every answer is parsed and validated against its schema. Requests interleave system by
system, the order rotating; figures are medians of ``--repeats`` passes; ratios of medians.
The grammar's own cost: its masks' time per emitted token, the daemon's (verification, forced
runs) and the workers' (drafting, decoding alone) together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import jsonschema

from hetspec.bench.busy_box import busy_note
from hetspec.bench.llama_server import (
    LlamaServer,
    LlamaServerError,
    ServerConfig,
    find_llama_server,
    timing_of,
)
from hetspec.bench.targets import smollm2_files
from hetspec.client.clients import Client
from hetspec.client.daemon_process import DaemonProcess
from hetspec.models.corpus import FORGET_PROMPT


def chat(message: str) -> str:
    """SmolLM2's chat template, as text (the same bytes reach every system)."""
    return f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"


def _text(limit: int) -> dict:
    return {"type": "string", "maxLength": limit}


SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": _text(40),
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": _text(60),
            "city": _text(40),
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "device command": {
        "type": "object",
        "properties": {
            "device": {
                "type": "object",
                "properties": {
                    "room": {"enum": ["kitchen", "bedroom", "living room", "garage"]},
                    "kind": {"enum": ["light", "heater", "fan", "door"]},
                },
                "required": ["room", "kind"],
                "additionalProperties": False,
            },
            "action": {"enum": ["on", "off", "dim", "open", "close"]},
            "level": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["device", "action"],
        "additionalProperties": False,
    },
    "shopping list": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 5,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": _text(30),
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                        "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    },
                    "required": ["name", "quantity", "price"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reason": _text(120),
        },
        "required": ["sentiment", "confidence", "reason"],
        "additionalProperties": False,
    },
    "tool call": {
        "type": "object",
        "properties": {
            "function": {"enum": ["get_weather", "set_timer", "send_message"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": _text(40),
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
                },
                "additionalProperties": False,
            },
        },
        "required": ["function", "arguments"],
        "additionalProperties": False,
    },
    "article tags": {
        "type": "object",
        "properties": {
            "title": _text(80),
            "tags": {"type": "array", "items": _text(20), "minItems": 1, "maxItems": 6},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["title", "tags"],
        "additionalProperties": False,
    },
}

QUESTIONS = {
    "person": "Invent a person who lives in Lisbon and describe them as JSON with their name, "
    "age, email and city.",
    "device command": "Turn the kitchen light down to 30 percent. Reply with the JSON command.",
    "shopping list": "I need three apples at 0.5 each, a loaf of bread for 2.20 and two liters "
    "of milk at 1.10. Write the shopping list as JSON.",
    "sentiment": "Classify the sentiment of this review as JSON: 'The battery lasts two days "
    "and the screen is gorgeous, but the speaker is tinny.'",
    "tool call": "What is the weather like in Paris in celsius? Reply with the tool call as JSON.",
    "article tags": "Give a title and tags as JSON for an article from 2024 about growing "
    "tomatoes on a balcony.",
}
SWEEP_SCHEMA = {
    "type": "object",
    "properties": {"name": _text(30), "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "colour"],
}
SWEEP_PROMPT = chat("Name a fruit and its colour as JSON.")


@dataclass
class Row:
    system: str
    schema: str
    tokens: int
    decode_ms: float
    ttft_ms: float
    valid: bool
    text: str
    drafted: int = 0
    accepted: int = 0
    forced: int = 0
    mask_ms: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.tokens - 1) / self.decode_ms * 1000 if self.decode_ms > 0 else 0.0


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


class Peer:
    """One llama-server configuration, started once, asked with the schema."""

    def __init__(self, server: LlamaServer) -> None:
        self.server = server

    def run(self, schema: str, max_tokens: int, temperature: float, seed: int | None) -> Row:
        reply = self.server.generate(
            chat(QUESTIONS[schema]),
            max_tokens,
            temperature,
            seed,
            ignore_eos=False,
            extra={"json_schema": SCHEMAS[schema]},
        )
        timing = timing_of(reply)
        text = reply.get("content", "")
        figures = (timing.tokens, timing.decode_ms, timing.ttft_ms)
        return Row("", schema, *figures, valid(text, SCHEMAS[schema]), text, *timing[3:5])


class Hetspec:
    """A hetspecd and a mode, asked with the schema through Ollama's ``format``."""

    def __init__(self, client: Client, mode: str) -> None:
        self.client, self.mode = client, mode

    def run(self, schema: str, max_tokens: int, temperature: float, seed: int | None) -> Row:
        # another prompt first, so that this one is prefilled in full as the peers' are
        self.client.generate(FORGET_PROMPT, max_tokens=2, mode="autoregressive")
        done = self.client.generate(
            chat(QUESTIONS[schema]),
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            mode=self.mode,
            format=SCHEMAS[schema],
        )
        timings, spec = done.timings, done.speculative or {}
        return Row(
            "",
            schema,
            len(done.tokens),
            timings["predicted_ms"],
            timings["ttft_ms"],
            valid(done.text, SCHEMAS[schema]),
            done.text,
            timings.get("draft_n", 0),
            timings.get("draft_n_accepted", 0),
            spec.get("grammar_forced", 0),
            spec.get("grammar_mask_ms", 0.0) + spec.get("grammar_worker_mask_ms", 0.0),
        )


def best_of(binary: Path, base: ServerConfig, variants: list[dict], say) -> ServerConfig:
    """The variant of ``base`` that decodes ``SWEEP_PROMPT`` under ``SWEEP_SCHEMA`` fastest
    (median of 3)."""
    best, best_rate = base, -1.0
    for variant in variants:
        config = replace(base, **variant)
        try:
            with LlamaServer(binary, config) as server:
                rates = []
                for _ in range(4):
                    reply = server.generate(
                        SWEEP_PROMPT, 96, ignore_eos=False, extra={"json_schema": SWEEP_SCHEMA}
                    )
                    timing = timing_of(reply)
                    rates.append((timing.tokens - 1) / timing.decode_ms * 1000)
        except LlamaServerError as error:
            say(f"  {variant}: {str(error).splitlines()[0]}")
            continue
        rate = statistics.median(rates[1:])  # the first warms up
        say(f"  {variant}: {rate:.1f} tok/s")
        if rate > best_rate:
            best, best_rate = config, rate
    return best


def tune_peers(binary: Path, target: Path, draft: Path, say) -> dict[str, ServerConfig]:
    say("llama-server alone: flash attention on / off")
    flash = [{"flash_attention": "on"}, {"flash_attention": "off"}]
    alone = best_of(binary, ServerConfig(target, context=4096), flash, say)
    say("llama-server with the draft model: draft length x p-min")
    sweep = [{"n_max": n, "p_min": p} for n in (1, 2, 4, 8) for p in (0.0, 0.75)]
    drafted = best_of(binary, replace(alone, draft=draft), sweep, say)
    return {"llama-server alone": alone, "llama-server speculative": drafted}


def measure(systems: dict, repeats: int, max_tokens: int, say) -> list[Row]:
    """Greedy: every schema ``repeats`` times in every system, interleaved, the order
    rotating; then one seeded pass at temperature 0.7."""
    for system in systems.values():  # warm up every system once
        system.run("sentiment", 16, 0.0, None)
    names, rows = list(systems), []
    for repeat in range(repeats + 1):
        sampled = repeat == repeats
        for index, schema in enumerate(SCHEMAS):
            shift = (repeat + index) % len(names)
            for name in names[shift:] + names[:shift]:
                row = systems[name].run(
                    schema, max_tokens, 0.7 if sampled else 0.0, 7 if sampled else None
                )
                row.system = f"{name} (t=0.7)" if sampled else name
                rows.append(row)
        say(f"pass {repeat + 1}/{repeats + 1} done" + (" (sampled)" if sampled else ""))
    return rows


def table(rows: list[Row]) -> list[str]:
    systems = list(dict.fromkeys(r.system for r in rows))
    lines = [
        "| system | decode tok/s (mean of schemas' medians) | TTFT ms | valid | "
        "accepted / drafted | forced tokens | mask us / token |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rates = {}
    for system in systems:
        mine = [r for r in rows if r.system == system]
        per_schema = [
            statistics.median(r.tokens_per_s for r in mine if r.schema == s)
            for s in dict.fromkeys(r.schema for r in mine)
        ]
        rates[system] = statistics.fmean(per_schema)
        ttft = statistics.median(r.ttft_ms for r in mine)
        drafted, accepted = sum(r.drafted for r in mine), sum(r.accepted for r in mine)
        tokens = sum(r.tokens for r in mine)
        forced = sum(r.forced for r in mine)
        masks = sum(r.mask_ms for r in mine) * 1000 / tokens if system.startswith("hetspec") else 0
        lines.append(
            f"| {system} | {rates[system]:.1f} | {ttft:.1f} | "
            f"{sum(r.valid for r in mine)}/{len(mine)} | "
            f"{f'{accepted}/{drafted}' if drafted else '-'} | "
            f"{forced if system.startswith('hetspec') else '-'} | "
            f"{f'{masks:.0f}' if masks else '-'} |"
        )
    greedy = {k: v for k, v in rates.items() if "t=0.7" not in k}
    base = greedy.get("hetspec autoregressive")
    peer = greedy.get("llama-server speculative")
    for system, rate in greedy.items():
        if system.startswith("hetspec adaptive") and base:
            lines.append(
                f"\n{system}: {rate / base:.2f}x hetspec autoregressive (the same grammar "
                f"without speculation), {rate / peer:.2f}x llama-server's best speculative "
                f"decoding, {rate / greedy['llama-server alone']:.2f}x llama-server alone"
            )
    return lines


def hetspec_daemons(target, draft) -> dict[str, DaemonProcess]:
    settings = {"target.gguf": str(target.gguf), "target.folder": target.folder_setting}
    command = [i for k, v in settings.items() for i in ("--set", f"{k}={json.dumps(v)}")]
    paired = [*command, "--set", f"draft.gguf={json.dumps(str(draft.gguf))}"]
    paired += ["--set", f"draft.folder={json.dumps(draft.folder_setting)}"]

    def process(args: list[str]) -> DaemonProcess:
        """Started and ready: each loads alone (its load-time runtime measurements, which are
        cached, would otherwise be timed against the other's load)."""
        run = Path(tempfile.mkdtemp(prefix="hetspec-bench-structured-"))
        daemon = DaemonProcess(run, *args, log=run / "hetspecd.log")
        daemon.wait_ready(900)
        return daemon

    pair = process(paired)
    try:
        return {"pair": pair, "target alone": process(command)}
    except BaseException:
        pair.stop()
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.structured_output", description=__doc__
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, help="write every request's figures here")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if note := busy_note():
        say(note)
    _, target, draft = smollm2_files("smollm2", None)
    binary = find_llama_server(True, progress=sys.stderr)
    tuned = tune_peers(binary, target.gguf, draft.gguf, say)
    daemons = hetspec_daemons(target, draft)
    servers = {name: LlamaServer(binary, config) for name, config in tuned.items()}
    try:
        systems: dict = {name: Peer(server) for name, server in servers.items()}
        for daemon in daemons.values():
            daemon.wait_ready(900)
        pair = Client(f"unix://{daemons['pair'].socket}")
        alone = Client(f"unix://{daemons['target alone'].socket}")
        systems["hetspec adaptive"] = Hetspec(pair, "adaptive")
        systems["hetspec autoregressive"] = Hetspec(pair, "autoregressive")
        systems["hetspec adaptive, no draft model"] = Hetspec(alone, "adaptive")
        rows = measure(systems, args.repeats, args.max_tokens, say)
    finally:
        for server in servers.values():
            server.close()
        for daemon in daemons.values():
            daemon.stop()
    stamp = time.strftime("%Y-%m-%d %H:%M")
    print(f"# Structured output: {target.gguf.name} ({stamp})\n")
    print(f"{len(SCHEMAS)} schemas, {args.repeats} greedy passes and one seeded pass at")
    print(f"temperature 0.7, at most {args.max_tokens} tokens. Peers at their sweep's best:")
    for name, config in tuned.items():
        knobs = f"flash attention {config.flash_attention}"
        if config.draft is not None:
            knobs += f", draft length {config.n_max}, p-min {config.p_min}"
        print(f"- {name}: {knobs}")
    print()
    print("\n".join(table(rows)))
    invalid = [r for r in rows if not r.valid]
    for row in invalid[:10]:
        print(f"\ninvalid ({row.system}, {row.schema}): {row.text[:300]!r}")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ | {"tps": r.tokens_per_s} for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

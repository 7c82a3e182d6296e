"""``python -m hetspec.bench.no_draft_model``: a target without a draft model, against llama-server.

The target alone and drafting from the text itself, on three kinds of prompt (code editing,
answering from a given text, free prose): hetspecd serving the target with no draft model
(modes autoregressive and adaptive, its model-free drafts weighed each round), and
llama-server alone and with its own n-gram speculation (``ngram-simple``, ``ngram-mod``), each
at the best of a sweep measured now on a prompt of its own (none of the bench's). Greedy; every
system stops at the model's end token or ``--max-tokens``, so all generate the target's own
tokens (a column compares them with llama-server alone's). Requests interleave system by
system, the order rotating; each figure is the median of ``--repeats`` passes, and ratios are
of medians. Decode tokens/s counts the tokens after the first (which comes with the prefill
in every system).
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

from hetspec.bench.busy_box import busy_note
from hetspec.bench.llama_server import (
    LlamaServer,
    LlamaServerError,
    ServerConfig,
    find_llama_server,
    timing_of,
)
from hetspec.bench.targets import BUNDLED_DRAFT, BUNDLED_TARGET, ModelFiles, smollm2_files
from hetspec.client.clients import Client
from hetspec.client.daemon_process import DaemonProcess
from hetspec.models.corpus import FORGET_PROMPT

CODE = '''def compute_total(items, tax_rate):
    """Sum the items' prices, with tax, skipping free ones."""
    total = 0.0
    for item in items:
        if item.price <= 0:
            continue
        total += item.price * item.quantity
    return total * (1 + tax_rate)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''

TEXT = (
    "The lighthouse at Saint Mathieu stands at the western tip of Brittany, beside the ruins "
    "of a Benedictine abbey. It was built in 1835 and electrified in 1937. Its light, 56 "
    "metres above the sea, can be seen 29 nautical miles away, and it flashes white once "
    "every fifteen seconds. Visitors can climb its 163 steps from April to September; the "
    "abbey's ruins are open all year. A semaphore station next to it still watches the "
    "shipping lanes of the Iroise Sea."
)


def chat(message: str) -> str:
    """SmolLM2's chat template, as text (the same bytes reach every system)."""
    return f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = {
    "code editing": [
        chat(
            "Rename the function compute_total to order_total and the parameter items to "
            f"products. Reply with the whole code only.\n\n```python\n{CODE}```"
        ),
        chat(f"Add a docstring to the function cheapest. Reply with the code only.\n\n{CODE}"),
    ],
    "answering from a text": [
        chat(f"{TEXT}\n\nWhen was the lighthouse built, and how far can its light be seen?"),
        chat(f"Summarize this text in three sentences.\n\n{TEXT}"),
    ],
    "free prose": [
        chat("Write a short story about a cat who learns to swim."),
        chat("Explain why the sky is blue to a ten year old."),
    ],
}
SWEEP_PROMPT = chat(
    "Change every print call to a logging.info call. Reply with the code only.\n\n"
    "def report(rows):\n    print('rows:', len(rows))\n    for row in rows:\n"
    "        print(row.name, row.value)\n    print('done')\n"
)
NGRAM_SIMPLE = [
    ("--spec-ngram-simple-size-n", str(n), "--spec-ngram-simple-size-m", str(m))
    for n in (2, 3, 4, 12)
    for m in (8, 16, 48)
]
MOD_FLAGS = ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max")
NGRAM_MOD = [
    tuple(
        item for flag, value in zip(MOD_FLAGS, values, strict=True) for item in (flag, str(value))
    )
    for values in ((4, 2, 16), (8, 4, 32), (12, 8, 48), (24, 48, 64))
]


@dataclass
class Row:
    system: str
    kind: str
    prompt: int
    tokens: list[int]
    decode_ms: float
    ttft_ms: float
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_ms * 1000 if self.decode_ms > 0 else 0.0


class Peer:
    """One llama-server configuration, started once."""

    def __init__(self, name: str, server: LlamaServer) -> None:
        self.name, self.server = name, server

    def run(self, prompt: str, max_tokens: int) -> tuple[list[int], float, float, int, int]:
        timing = timing_of(self.server.generate(prompt, max_tokens, ignore_eos=False))
        return list(timing.ids), timing.decode_ms, timing.ttft_ms, *timing[3:5]


def best_of(binary: Path, base: ServerConfig, variants, max_tokens: int, say) -> ServerConfig:
    """The variant of ``base`` that decodes ``SWEEP_PROMPT`` fastest (median of 3)."""
    best, best_rate = base, -1.0
    for variant in variants:
        config = replace(base, **variant)
        try:
            with LlamaServer(binary, config) as server:
                server.generate(SWEEP_PROMPT, 8, ignore_eos=False)  # warm up
                rates = []
                for _ in range(3):
                    timing = timing_of(server.generate(SWEEP_PROMPT, max_tokens, ignore_eos=False))
                    rates.append((timing.tokens - 1) / timing.decode_ms * 1000)
        except LlamaServerError as error:
            say(f"  {variant}: {str(error).splitlines()[0]}")
            continue
        rate = statistics.median(rates)
        say(f"  {variant}: {rate:.1f} tok/s")
        if rate > best_rate:
            best, best_rate = config, rate
    return best


def hetspec_row(client: Client, mode: str, prompt: str, max_tokens: int):
    # another prompt first, so that this one is prefilled in full as the peers' are (the
    # worker keeps the prefix a request left)
    client.generate(FORGET_PROMPT, max_tokens=2, mode="autoregressive")
    done = client.generate(prompt, max_tokens=max_tokens, temperature=0.0, mode=mode)
    timings = done.timings
    return (
        done.tokens,
        timings["predicted_ms"],
        timings["ttft_ms"],
        timings.get("draft_n", 0),
        timings.get("draft_n_accepted", 0),
    )


def table(rows: list[Row], reference: str) -> list[str]:
    """Per kind of prompt and system: median decode tok/s (min-max over passes, per prompt
    medians then their mean), TTFT, tokens equal to ``reference``'s, acceptance."""
    kinds = list(dict.fromkeys(r.kind for r in rows))
    systems = list(dict.fromkeys(r.system for r in rows))
    lines = []
    for kind in kinds:
        lines += [
            f"\n### {kind}\n",
            "| system | decode tok/s (median; min-max) | TTFT ms | tokens = "
            f"{reference}'s | accepted / drafted |",
            "|---|---:|---:|---:|---:|",
        ]
        rates = {}
        for system in systems:
            mine = [r for r in rows if r.kind == kind and r.system == system]
            prompts = sorted({r.prompt for r in mine})
            per_prompt = [
                statistics.median(r.tokens_per_s for r in mine if r.prompt == p) for p in prompts
            ]
            passes = [r.tokens_per_s for r in mine]
            rates[system] = statistics.fmean(per_prompt)
            ttft = statistics.median(r.ttft_ms for r in mine)
            ref = {r.prompt: r.tokens for r in rows if r.kind == kind and r.system == reference}
            same = sum(r.tokens == ref.get(r.prompt) for r in mine)
            drafted, accepted = sum(r.drafted for r in mine), sum(r.accepted for r in mine)
            share = f"{accepted}/{drafted}" if drafted else "-"
            lines.append(
                f"| {system} | {rates[system]:.1f} ({min(passes):.1f}-{max(passes):.1f}) | "
                f"{ttft:.1f} | {same}/{len(mine)} | {share} |"
            )
        alone = max(v for k, v in rates.items() if "alone" in k or "autoregressive" in k)
        peers = [v for k, v in rates.items() if "ngram" in k]
        for system, rate in rates.items():
            if system.startswith("hetspec adaptive"):  # also "... on llama.cpp"
                text = f"\n{system}: {rate / alone:.2f}x the fastest target alone"
                if peers:
                    text += f", {rate / max(peers):.2f}x llama-server's best n-gram speculation"
                lines.append(text)
    return lines


def resolve_target(spec: str) -> ModelFiles:
    if spec == "smollm2":
        return smollm2_files("smollm2", None)[1]
    if spec == "bundled":
        return BUNDLED_TARGET
    gguf = Path(spec)
    return ModelFiles(gguf.parent if (gguf.parent / "config.json").is_file() else None, gguf)


def tune_peers(binary: Path, target: ModelFiles, max_tokens: int, say) -> dict:
    """llama-server's configurations at the best of their sweeps, by row name."""
    say("llama-server alone: flash attention on / off")
    flash = [{"flash_attention": "on"}, {"flash_attention": "off"}]
    alone = best_of(binary, ServerConfig(target.gguf, context=4096), flash, max_tokens, say)
    tuned = {"llama-server alone": alone}
    for kind, sweep in (("ngram-simple", NGRAM_SIMPLE), ("ngram-mod", NGRAM_MOD)):
        say(f"llama-server {kind}")
        variants = [{"spec_args": args} for args in sweep]
        base = replace(alone, spec_type=kind)
        tuned[f"llama-server {kind}"] = best_of(binary, base, variants, max_tokens, say)
    return tuned


def hetspecd_process(command: list[str]) -> DaemonProcess:
    """hetspecd started and ready: each loads alone, since the runtimes it measures at load
    (and caches) would otherwise be timed against the others' loads."""
    run = Path(tempfile.mkdtemp(prefix="hetspec-bench-no-draft-"))
    daemon = DaemonProcess(run, *command, log=run / "hetspecd.log")
    daemon.wait_ready(900)
    return daemon


def measure(systems: dict, repeats: int, max_tokens: int, say) -> list[Row]:
    """Every prompt ``repeats`` times in every system (a ``Peer``, or a daemon's client and
    mode), interleaved, the order rotating."""
    for system in systems.values():  # warm up every system once
        if isinstance(system, Peer):
            system.run(SWEEP_PROMPT, 8)
        else:
            hetspec_row(*system, SWEEP_PROMPT, 8)
    names, rows = list(systems), []
    for repeat in range(repeats):
        for kind, prompts in PROMPTS.items():
            for index, prompt in enumerate(prompts):
                shift = (repeat + index) % len(names)
                for name in names[shift:] + names[:shift]:
                    system = systems[name]
                    if isinstance(system, Peer):
                        figures = system.run(prompt, max_tokens)
                    else:
                        figures = hetspec_row(*system, prompt, max_tokens)
                    rows.append(Row(name, kind, index, *figures))
        say(f"pass {repeat + 1}/{repeats} done")
    return rows


def hetspec_daemons(target: ModelFiles, spec: str, *, with_draft: bool) -> dict:
    """hetspecd on the target alone (the runtime chosen at load; llama.cpp's, the peer's own
    kernels), and with ``with_draft`` on the pair with the target's draft model, with and
    without model-free drafts; by row suffix."""
    settings = {"target.gguf": str(target.gguf), "target.folder": target.folder_setting}
    command = [i for k, v in settings.items() for i in ("--set", f"{k}={json.dumps(v)}")]
    commands = {"": command, " on llama.cpp": [*command, "--set", 'gpu_runtime="llama.cpp"']}
    if with_draft:
        draft = smollm2_files("smollm2", None)[2] if spec == "smollm2" else BUNDLED_DRAFT
        paired = [*command, "--set", f"draft.gguf={json.dumps(str(draft.gguf))}"]
        paired += ["--set", f"draft.folder={json.dumps(draft.folder_setting)}"]
        commands[" with the draft model"] = paired
        off = [*paired, "--set", 'model_free_draft="off"']
        commands[" with the draft model, no model-free drafts"] = off
    daemons: dict[str, DaemonProcess] = {}
    try:
        for suffix, args in commands.items():
            daemons[suffix] = hetspecd_process(args)
    except BaseException:
        for daemon in daemons.values():
            daemon.stop()
        raise
    return daemons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.no_draft_model", description=__doc__
    )
    parser.add_argument("--target", default="smollm2", help='"smollm2", "bundled" or a GGUF')
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--json", type=Path, help="write every request's figures here")
    parser.add_argument(
        "--with-draft",
        action="store_true",
        help="also hetspecd with the target's draft model (SmolLM2's: the one hetspec trains), "
        "its adaptive mode with and without model-free drafts",
    )
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    target = resolve_target(args.target)
    if note := busy_note():
        say(note)
    binary = find_llama_server(True, progress=sys.stderr)
    tuned = tune_peers(binary, target, args.max_tokens, say)
    daemons = hetspec_daemons(target, args.target, with_draft=args.with_draft)
    servers = {name: LlamaServer(binary, config) for name, config in tuned.items()}
    try:
        systems: dict = {name: Peer(name, server) for name, server in servers.items()}
        for suffix, hetspecd in daemons.items():
            hetspecd.wait_ready(900)
            client = Client(f"unix://{hetspecd.socket}")
            if "draft model" not in suffix:  # the same target alone as the row above
                systems[f"hetspec autoregressive{suffix}"] = (client, "autoregressive")
            systems[f"hetspec adaptive{suffix}"] = (client, "adaptive")
        rows = measure(systems, args.repeats, args.max_tokens, say)
    finally:
        for server in servers.values():
            server.close()
        for hetspecd in daemons.values():
            hetspecd.stop()
    stamp = time.strftime("%Y-%m-%d %H:%M")
    print(f"# Drafting without a draft model: {target.gguf.name} ({stamp})\n")
    print(f"{args.repeats} passes, greedy, at most {args.max_tokens} tokens (each stops at the")
    print("end token). Peers at the best of their sweep on a prompt of its own:")
    for name, config in tuned.items():
        print(f"- {name}: flash attention {config.flash_attention} {' '.join(config.spec_args)}")
    print("\n".join(table(rows, "llama-server alone")))
    for system in sorted({r.system for r in rows if r.system.startswith("hetspec adaptive")}):
        own = system.replace("adaptive", "autoregressive")
        alone = {(r.kind, r.prompt): r.tokens for r in rows if r.system == own}
        if not alone:  # with the draft model: its verifier's runtime has no row of its own
            continue
        mine = [r for r in rows if r.system == system]
        same = sum(r.tokens == alone[r.kind, r.prompt] for r in mine)
        print(f"\n{system}: tokens = {own}'s in {same}/{len(mine)} requests")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ | {"tps": r.tokens_per_s} for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One request's outcome in ``hetspec bench`` (a ``Record``), and the summaries of many.

Contract: a ``Record`` holds what the daemon's final object (or the peers' process) reported
of one request, as it reported it: tokens, decode and first-token times, and for speculative
modes the rounds, acceptance and the round's parts. ``summarise`` reduces one system's records
to the figures the tables show: decode tokens/s is all tokens over all decode time per pass
(each prompt weighs its length), then the median over passes; TTFT the median over requests.
Outputs are compared as digests of the token ids (``token_digest``).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass, field

from hetspec.client.types import Completion


@dataclass
class Record:
    """One request's outcome, as the daemon's final object reports it."""

    system: str
    prompt: int
    repeat: int
    loaded: bool
    tokens: int
    decode_ms: float
    ttft_ms: float
    rounds: int = 0
    accepted: int = 0
    gamma_mean: float = 0.0
    t_draft_ms: float | None = None
    t_verify_ms: float | None = None
    overlapped: int = 0  # rounds whose next draft was drafted during verification
    # the daemon's share: its own work a round, and a call's time beyond the worker's own
    t_overhead_ms: float | None = None
    t_draft_link_ms: float | None = None
    t_verify_link_ms: float | None = None
    gammas: list[int] = field(default_factory=list)
    by_depth: list[int] = field(default_factory=list)  # rounds accepting >= depth 1, 2, ...
    output: str = ""  # a digest of the token ids generated ("": a peer's, not compared)
    t_prefill_wait_ms: float | None = None  # waiting for the drafter's late prefill
    branches: list[int] = field(default_factory=list)  # each round's, as gammas (last 64)
    drafted: int = 0  # draft tokens offered to the target (llama-server's draft_n)

    @classmethod
    def of(cls, system: str, prompt: int, repeat: int, loaded: bool, done: Completion) -> Record:
        timings, spec = done.timings, done.speculative or {}
        gammas = spec.get("gamma_history", [])
        return cls(
            system,
            prompt,
            repeat,
            loaded,
            timings["predicted_n"],
            timings["predicted_ms"],
            timings["ttft_ms"],
            spec.get("rounds", 0),
            timings.get("draft_n_accepted", 0),
            statistics.fmean(gammas) if gammas else 0.0,
            spec.get("t_draft_ms"),
            spec.get("t_verify_ms"),
            spec.get("run_ahead", 0),
            spec.get("t_overhead_ms"),
            spec.get("t_draft_link_ms"),
            spec.get("t_verify_link_ms"),
            gammas,
            spec.get("acceptance_by_depth", []),
            token_digest(done.tokens),
            t_prefill_wait_ms=spec.get("t_prefill_wait_ms"),
            branches=spec.get("branch_history", []),
            drafted=timings.get("draft_n", 0),
        )

    @property
    def branched_rounds(self) -> tuple[int, int]:
        """(drafted rounds of more than one branch, drafted rounds) in the histories."""
        drafted = [b for g, b in zip(self.gammas, self.branches, strict=False) if g > 0]
        return sum(b > 1 for b in drafted), len(drafted)

    @property
    def decoded(self) -> int:
        """Tokens decoded after the first, which comes with the prefill in every system."""
        return self.tokens - 1

    @property
    def tokens_per_s(self) -> float:
        return self.decoded / self.decode_ms * 1000

    @property
    def ideal_tokens_per_s(self) -> float | None:
        """(mean accepted + 1) / max(gamma * T_draft, T_verify): perfect overlap, no overhead."""
        if not self.rounds or not self.t_draft_ms or not self.t_verify_ms:
            return None
        round_ms = max(self.gamma_mean * self.t_draft_ms, self.t_verify_ms)
        return (self.accepted / self.rounds + 1) / round_ms * 1000


def token_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def same_output(records: list[Record], reference: list[Record]) -> tuple[int, int] | None:
    """(requests whose tokens equal the reference system's for the same prompt and repeat,
    requests compared); None for rows without outputs (peers)."""
    expected = {(r.prompt, r.repeat): r.output for r in reference if r.output}
    pairs = [(r.output, expected.get((r.prompt, r.repeat))) for r in records if r.output]
    pairs = [(mine, theirs) for mine, theirs in pairs if theirs is not None]
    if not pairs:
        return None
    return sum(mine == theirs for mine, theirs in pairs), len(pairs)


def summarise(records: list[Record]) -> dict:
    """Per repeat: all tokens over all decode time (each prompt weighs its length); then the
    median over repeats. TTFT: median over requests."""
    by_repeat: dict[int, list[Record]] = {}
    for record in records:
        by_repeat.setdefault(record.repeat, []).append(record)
    rates = [
        sum(r.decoded for r in rs) / sum(r.decode_ms for r in rs) * 1000
        for rs in by_repeat.values()
    ]
    rounds = sum(r.rounds for r in records)
    ideal = [r.tokens_per_s / r.ideal_tokens_per_s for r in records if r.ideal_tokens_per_s]
    drafted = sum(r.drafted for r in records)
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_range": (min(rates), max(rates)),  # over the passes
        "passes": len(rates),
        "acceptance": sum(r.accepted for r in records) / drafted if drafted else None,
        "ttft_ms": statistics.median(r.ttft_ms for r in records),
        "mean_accepted": sum(r.accepted for r in records) / rounds if rounds else None,
        "gamma_mean": statistics.fmean(r.gamma_mean for r in records) if rounds else None,
        "efficiency": statistics.median(ideal) if ideal else None,
        "overlapped": sum(r.overlapped for r in records) / rounds if rounds else None,
        "requests": len(records),
    }

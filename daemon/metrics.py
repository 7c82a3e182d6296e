"""Prometheus metrics of one daemon: its own registry, no process-global state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

MAX_DEPTH = 16  # acceptance by position is exported for the first 16 draft positions


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "hetspec_http_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.connections_refused = Counter(
            "hetspec_http_connections_refused",
            "HTTP connections refused (503) because http_max_connections were open",
            registry=r,
        )
        self.generations = Counter(
            "hetspec_generations",
            "Generations ended, by mode and reason: stop, length, error, or cancelled (the "
            "client left or hetspecd stopped)",
            ["mode", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("hetspec_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter(
            "hetspec_generated_tokens", "Verified tokens generated", registry=r
        )
        self.ttft = Histogram(
            "hetspec_time_to_first_token_seconds",
            "Request start to first verified token",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.decode_rate = Histogram(
            "hetspec_decode_tokens_per_second",
            "Decode speed of a request (excluding prefill)",
            registry=r,
            buckets=(5, 10, 25, 50, 100, 200, 400, 800, 1600),
        )
        self.queue_wait = Histogram(
            "hetspec_queue_wait_seconds", "Time waited for a turn", registry=r
        )
        self.rounds = Counter("hetspec_speculative_rounds", "Draft/verify rounds", registry=r)
        self.drafted = Counter("hetspec_draft_tokens", "Tokens drafted", registry=r)
        self.accepted = Counter(
            "hetspec_draft_accepted_tokens", "Drafted tokens accepted", registry=r
        )
        self.accepted_at = Counter(
            "hetspec_rounds_accepted_at_depth",
            "Rounds whose draft "
            "was accepted up to at least this position (divide by "
            "hetspec_speculative_rounds_total for acceptance by "
            "position)",
            ["depth"],
            registry=r,
        )
        self.gamma = Gauge("hetspec_gamma", "Draft length of the latest round", registry=r)
        self.queue_waiting = Gauge("hetspec_queue_waiting", "Requests waiting", registry=r)
        self.queue_running = Gauge(
            "hetspec_queue_running", "Requests decoding (at most max_parallel)", registry=r
        )
        self.queue_refused = Gauge(
            "hetspec_queue_refused", "Requests refused with 429 since start", registry=r
        )
        self.worker_restarts = Gauge(
            "hetspec_worker_restarts", "Restarts of each worker since start", ["worker"], registry=r
        )
        self.worker_up = Gauge(
            "hetspec_worker_up", "1 while the worker is ready", ["worker"], registry=r
        )

    def observe_generation(
        self,
        *,
        mode: str,
        reason: str,
        prompt_tokens: int,
        tokens: int,
        ttft_ms: float | None,
        decode_ms: float,
        speculative: dict | None,
    ) -> None:
        self.generations.labels(mode, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(tokens)
        if ttft_ms is not None:
            self.ttft.observe(ttft_ms / 1000)
        if tokens and decode_ms > 0:
            self.decode_rate.observe(tokens / (decode_ms / 1000))
        if speculative:
            self.rounds.inc(speculative["rounds"])
            self.drafted.inc(speculative["draft_n"])
            self.accepted.inc(speculative["draft_n_accepted"])
            for depth, count in enumerate(speculative["acceptance_by_depth"][:MAX_DEPTH], 1):
                self.accepted_at.labels(str(depth)).inc(count)
            if speculative["gamma_history"]:
                self.gamma.set(speculative["gamma_history"][-1])

    def render(self) -> bytes:
        return generate_latest(self.registry)

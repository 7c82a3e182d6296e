"""Structured logging, configured once per process.

Every hetspec process (daemon, workers, CLI) calls :func:`configure_logging` first thing.
Not on a TTY (systemd/journald, CI, pipes) each event is one JSON object per line on stderr;
on a TTY it is rendered for people. Records from the standard ``logging`` module (aiohttp,
asyncio, ...) go through the same renderer, so a journal never mixes formats.

Tracebacks never show local variables: a frame's locals may hold a secret (the TCP bearer
token). Warnings and errors are rate-limited per event (:class:`RateLimit`), so a client that
can trigger one cannot flood the journal.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer

LogFormat = Literal["auto", "json", "console"]
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(
    level: str = "info",
    log_format: LogFormat = "auto",
    stream: TextIO | None = None,
    **context: object,
) -> None:
    """Route structlog and stdlib logging to ``stream`` (stderr by default).

    ``context`` is bound to every event of this process (e.g. ``process="cpu-worker"``).
    Calling it again replaces the earlier configuration rather than stacking handlers.
    """
    stream = stream if stream is not None else sys.stderr
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    as_json = log_format == "json" or (log_format == "auto" and not stream.isatty())

    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.types.Processor
    if as_json:
        tracebacks = ExceptionDictTransformer(show_locals=False)
        shared.append(structlog.processors.ExceptionRenderer(tracebacks))
        renderer = structlog.processors.JSONRenderer()
    else:  # (rich's tracebacks, the default where rich is installed, show locals)
        renderer = structlog.dev.ConsoleRenderer(
            colors=stream.isatty(), exception_formatter=structlog.dev.plain_traceback
        )

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.addFilter(RateLimit())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.stdlib.get_logger(name)


@dataclass
class _Bucket:
    tokens: float
    updated: float
    limited: bool = False  # the notice was logged; records are dropped and counted
    suppressed: int = 0


class RateLimit(logging.Filter):
    """A token bucket per (logger, event) for records at warning level and above: at most
    ``burst`` of one event pass in a row, refilled at ``burst`` per ``interval_s``.

    The first record over the limit still passes, as a notice (``rate_limited``, no traceback)
    that similar ones are dropped from now on; each record that passes again carries
    ``suppressed``: how many were dropped since the last line. A flood is thus ``burst`` lines
    and the notice, then one line per refill. Events are told apart by their template
    (structlog's event name, a stdlib record's unformatted message), not by their values.
    Debug and info records always pass.
    """

    MAX_EVENTS = 1024  # buckets kept; idle full ones are forgotten beyond this

    def __init__(
        self,
        burst: int = 10,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.burst = burst
        self.rate = burst / interval_s
        self.clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = self.clock()
        key = (record.name, _event_of(record))
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.MAX_EVENTS:
                self._forget_idle(now)
            bucket = self._buckets[key] = _Bucket(tokens=self.burst, updated=now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.tokens >= 1:
            if bucket.suppressed:
                _annotate(record, suppressed=bucket.suppressed)
                bucket.suppressed = 0
            # a full bucket again: the next run over the limit gets a notice of its own
            bucket.limited = bucket.limited and bucket.tokens < self.burst
            bucket.tokens -= 1
            return True
        if bucket.limited:
            bucket.suppressed += 1
            return False
        bucket.limited = True
        _annotate(
            record,
            rate_limited="more of this event follow than the log takes; "
            "similar ones are dropped for now and counted",
        )
        # the notice, not one more traceback
        record.exc_info = record.exc_text = None
        if isinstance(record.msg, dict):
            record.msg = {k: v for k, v in record.msg.items() if k not in ("exception", "exc_info")}
        return True

    def _forget_idle(self, now: float) -> None:
        for key, bucket in list(self._buckets.items()):
            refilled = bucket.tokens + (now - bucket.updated) * self.rate
            if refilled >= self.burst and not bucket.limited:
                del self._buckets[key]


def _event_of(record: logging.LogRecord) -> str:
    """structlog's records carry the event dict as ``msg``; stdlib ones a format string."""
    if isinstance(record.msg, dict):
        return str(record.msg.get("event"))
    return str(record.msg)


def _annotate(record: logging.LogRecord, **fields: object) -> None:
    if isinstance(record.msg, dict):
        record.msg = {**record.msg, **fields}
    else:
        extra = ", ".join(f"{key}={value}" for key, value in fields.items())
        record.msg, record.args = f"{record.getMessage()} ({extra})", None

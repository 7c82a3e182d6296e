"""Structured logging, configured once per process.

Every hetspec process (daemon, workers, CLI) calls :func:`configure_logging` first thing.
Not on a TTY (systemd/journald, CI, pipes) each event is one JSON object per line on stderr;
on a TTY it is rendered for people. Records from the standard ``logging`` module (aiohttp,
asyncio, ...) go through the same renderer, so a journal never mixes formats.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog

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
        shared.append(structlog.processors.dict_tracebacks)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
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

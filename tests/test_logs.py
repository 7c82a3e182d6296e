"""Logs are JSON lines off a terminal (journald) and readable text on one."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

import pytest

from hetspec.logs import configure_logging

pytestmark = pytest.mark.process  # a process with or without a terminal

EMIT = (
    "import logging\n"
    "from hetspec.logs import configure_logging, get_logger\n"
    "configure_logging('info', process='test-proc')\n"
    "get_logger('hetspec.test').info('worker ready', pid=123, device='cpu')\n"
    "get_logger('hetspec.test').debug('hidden below the level')\n"
    "logging.getLogger('aiohttp.access').warning('from stdlib %s', 'logging')\n"
    "try:\n"
    "    1 / 0\n"
    "except ZeroDivisionError:\n"
    "    get_logger('hetspec.test').exception('it broke')\n"
)


def test_json_lines_on_stderr_when_not_a_tty() -> None:
    result = subprocess.run(
        [sys.executable, "-c", EMIT], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout == ""
    events = [json.loads(line) for line in result.stderr.splitlines()]
    assert [e["event"] for e in events] == ["worker ready", "from stdlib logging", "it broke"]
    ready, stdlib, broke = events
    assert ready["pid"] == 123
    assert ready["device"] == "cpu"
    assert ready["level"] == "info"
    assert ready["process"] == "test-proc"
    assert ready["timestamp"].endswith("Z")
    assert stdlib["logger"] == "aiohttp.access"
    assert stdlib["level"] == "warning"
    assert stdlib["process"] == "test-proc"
    assert broke["exception"][0]["exc_type"] == "ZeroDivisionError"


def test_readable_text_on_a_tty() -> None:
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", EMIT],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=terminal,
        )
        os.close(terminal)
        output = b""
        while chunk := _read(controller):
            output += chunk
        assert process.wait(timeout=60) == 0
    finally:
        os.close(controller)
    text = re.sub(r"\x1b\[[0-9;]*m", "", output.decode())
    assert "worker ready" in text
    assert "pid=123" in text
    assert "Traceback" in text
    assert "ZeroDivisionError" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: the child closed the terminal
        return b""


def test_unknown_level_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="log level must be one of debug, info, warning, error"):
        configure_logging("verbose")

"""Route llama.cpp's log to structlog and keep its last lines for error messages.

llama.cpp explains a failed load (bad magic, truncated tensor data, unknown architecture) only
in its log, and by default prints every loading detail on stderr. Its log hook is one per
process, so the worker installs this once; warnings and errors go to our log, the rest is kept
in a short ring buffer that ``LlamaCppError`` quotes.
"""

from __future__ import annotations

import ctypes
import functools
from collections import deque

import llama_cpp

from hetspec.logs import get_logger

_WARN, _ERROR, _CONTINUATION = 3, 4, 5


class LlamaLog:
    def __init__(self, keep: int = 30) -> None:
        self.recent: deque[str] = deque(maxlen=keep)
        self.count = 0  # lines received so far; a mark for since()
        self._partial = ""
        self._level = 0
        self._logger = get_logger("llama.cpp")
        # ctypes must keep the callback object alive as long as llama.cpp may call it.
        self._callback = llama_cpp.llama_log_callback(self._receive)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _receive(self, level: int, text: bytes, _user_data: int) -> None:
        if level != _CONTINUATION:
            self._level = level
        self._partial += text.decode("utf-8", "replace")
        *lines, self._partial = self._partial.split("\n")
        for line in filter(None, (line.strip() for line in lines)):
            self.recent.append(line)
            self.count += 1
            if self._level == _ERROR:
                self._logger.error("llama.cpp", message=line)
            elif self._level == _WARN:
                self._logger.warning("llama.cpp", message=line)

    def since(self, mark: int) -> list[str]:
        """The lines received after ``count`` was ``mark`` (as many as the buffer kept)."""
        new = min(self.count - mark, len(self.recent))
        return list(self.recent)[len(self.recent) - new :] if new > 0 else []


@functools.cache  # llama.cpp has one log hook per process: install it once
def llama_log() -> LlamaLog:
    return LlamaLog()

"""How a call to a worker, or a worker's start, fails: what the daemon's callers catch.

Contract: ``WorkerError`` is a worker's answer ``Failed`` (or the daemon's own verdict on a
call: ``lost``, ``timeout``, ``overloaded``), its ``kind`` saying what sort of failure and its
``message`` the worker's words; ``WorkerDied`` (a ``WorkerError`` of kind ``died``) fails
every call in flight once the worker is gone; ``WorkerStartError`` says why a worker could
not be started or could not load its model.
"""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker answered a command with ``Failed``; ``kind`` says what sort of failure."""

    def __init__(self, worker: str, kind: str, message: str, text: str | None = None) -> None:
        super().__init__(text or f"{worker} worker: {message}")
        self.worker, self.kind, self.message = worker, kind, message


class WorkerDied(WorkerError):
    def __init__(self, worker: str, reason: str) -> None:
        super().__init__(worker, "died", reason, f"the {worker} worker {reason}")


class WorkerStartError(RuntimeError):
    """A worker could not be started or could not load its model."""

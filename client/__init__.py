"""How people and programs reach hetspecd: the client library and the ``hetspec`` shell client.

Depends only on ``hetspec.protocol``; it talks to the daemon over its socket, never in-process.
"""

from hetspec.client.clients import AsyncClient, AsyncStream, Client, Stream
from hetspec.client.types import (
    ApiError,
    BadRequest,
    Completion,
    DaemonUnreachable,
    GenerationFailed,
    HetspecError,
    QueueFull,
    Unavailable,
)

__all__ = [
    "ApiError",
    "AsyncClient",
    "AsyncStream",
    "BadRequest",
    "Client",
    "Completion",
    "DaemonUnreachable",
    "GenerationFailed",
    "HetspecError",
    "QueueFull",
    "Stream",
    "Unavailable",
]

"""Multipart framing: one MessagePack frame for the message, then one frame per small array.

Arrays are sent as their own buffers (pyzmq sends large ones without copying) and received as
read-only numpy views of the received frames. A message refers to them with ``ArrayRef``
(``frame`` = the index of the frame). Nothing here ever unpickles anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from hetspec.protocol.arena import ArrayRef

Message = TypeVar("Message")


class MessageError(ValueError):
    """Frames that are not a valid message of the expected direction."""


def frame_ref(array: np.ndarray, frame: int) -> ArrayRef:
    return ArrayRef(array.dtype.str, tuple(array.shape), frame=frame)


def frame_array(ref: ArrayRef, frames: Sequence[Any]) -> np.ndarray:
    """The array ``ref`` points at among ``frames`` (bytes or buffers), as a view."""
    if not 1 <= ref.frame < len(frames):
        raise MessageError(f"array in frame {ref.frame}, but the message has {len(frames)} frames")
    buffer = memoryview(frames[ref.frame])
    if buffer.nbytes != ref.nbytes:
        raise MessageError(f"frame {ref.frame} has {buffer.nbytes} bytes, expected {ref.nbytes}")
    return np.frombuffer(buffer, dtype=np.dtype(ref.dtype)).reshape(ref.shape)


class Codec(Generic[Message]):
    """Encodes any message; decodes only the union ``incoming`` (the other side's messages)."""

    def __init__(self, incoming: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def encode(self, message: msgspec.Struct, arrays: Sequence[np.ndarray] = ()) -> list:
        """Frames for ``message``; ``arrays[i]`` travels as frame i + 1."""
        return [self._encoder.encode(message), *(np.ascontiguousarray(a) for a in arrays)]

    def decode(self, frames: Sequence[Any]) -> Message:
        if not frames:
            raise MessageError("an empty message")
        try:
            return self._decoder.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise MessageError(f"not a valid message: {error}") from None

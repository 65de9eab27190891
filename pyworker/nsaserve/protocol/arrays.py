"""Little-endian raw arrays inside msgpack `bin` values, viewed without copying."""

from __future__ import annotations

import numpy as np

# The wire dtypes, fixed by the protocol (docs/protocol.md): always little-endian.
U8 = np.dtype("<u1")
I32 = np.dtype("<i4")
U32 = np.dtype("<u4")
U64 = np.dtype("<u8")
F32 = np.dtype("<f4")


class ProtocolError(ValueError):
    """A message that does not follow docs/protocol.md."""


def view(msg: dict, key: str, dtype: np.dtype) -> np.ndarray:
    """A read-only numpy view of the `bin` field `key` (no copy)."""
    try:
        raw = msg[key]
    except KeyError:
        raise ProtocolError(f"missing field {key!r}") from None
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"field {key!r} must be bin, got {type(raw).__name__}")
    if len(raw) % dtype.itemsize:
        raise ProtocolError(f"field {key!r}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte elements")
    return np.frombuffer(raw, dtype=dtype)


def to_bin(values, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(values, dtype=dtype).tobytes()

"""Numpy arrays on the JSON wire: the array envelope and CSR rows (graph.md §5)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any

import numpy as np


class PackedArrayError(ValueError):
    """An array envelope that cannot be decoded; messages start `invalid packed array`."""


def pack(array: np.ndarray) -> dict[str, Any]:
    """Envelope of the C-contiguous little-endian bytes, with shape and dtype name."""
    arr = np.ascontiguousarray(array)
    arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return {
        "data": base64.b64encode(arr.tobytes()).decode("ascii"),
        "shape": list(arr.shape),
        "dtype": arr.dtype.name,
    }


def unpack(envelope: Any) -> np.ndarray:
    """Decode an envelope; any malformation raises PackedArrayError naming what is wrong."""
    if not isinstance(envelope, dict):
        raise PackedArrayError(
            f"invalid packed array: expected an object, got {type(envelope).__name__}"
        )
    data, shape, dtype = envelope.get("data"), envelope.get("shape"), envelope.get("dtype")
    if not isinstance(data, str):
        raise PackedArrayError("invalid packed array: `data` must be a base64 string")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise PackedArrayError(f"invalid packed array: bad shape {shape!r}")
    try:
        dt = np.dtype(dtype).newbyteorder("<")
    except TypeError as exc:
        raise PackedArrayError(f"invalid packed array: unknown dtype {dtype!r}") from exc
    if dt.hasobject or dt.kind not in "biuf":
        raise PackedArrayError(f"invalid packed array: unsupported dtype {dtype!r}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PackedArrayError(f"invalid packed array: bad base64: {exc}") from exc
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(raw) != count * dt.itemsize:
        raise PackedArrayError(
            f"invalid packed array: {len(raw)} bytes for shape {shape} of {dt.name}"
        )
    # A bytearray makes the array writable (torch.from_numpy warns on read-only memory).
    return np.frombuffer(bytearray(raw), dtype=dt).reshape(shape)


def rows_to_csr(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Row lists to (ids int32, offsets int64 with a leading 0)."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    if rows:
        offsets[1:] = np.cumsum([len(r) for r in rows])
    ids = np.fromiter((i for r in rows for i in r), dtype=np.int32, count=int(offsets[-1]))
    return ids, offsets


def csr_to_rows(ids: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    flat = ids.tolist()
    bounds = offsets.tolist()
    return [flat[bounds[r] : bounds[r + 1]] for r in range(len(bounds) - 1)]

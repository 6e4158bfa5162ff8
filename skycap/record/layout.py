"""Record file names and sidecar payloads: 8-aligned little-endian arrays (format.md §6)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
DOCUMENT_SUFFIX = ".json.zst"
ALIGN = 8
# format.md §6.1: a writer refuses every other dtype; a reader refuses them too.
DTYPES = ("uint8", "uint16", "int16", "int32", "int64", "float64")


class RecordError(Exception):
    """A record that cannot be read; its str is a one-line reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(" ".join(reason.splitlines()))


def new_run_dir(root: str | Path, name: str) -> Path:
    """A new, empty folder `root/<name>-<YYYYMMDD-HHMMSS>` for one run's records (created).

    Runs that share a folder mix: a second run's trajectories sit beside the first's, and
    the viewer's groups and `skycap check` read them as one run. Each run in its own folder
    under a shared root is what `skycap view ROOT` lists as separate runs.
    """
    base = Path(root) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    Path(root).mkdir(parents=True, exist_ok=True)
    folder, n = base, 1
    while True:
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            n += 1
            folder = base.with_name(f"{base.name}-{n}")


def document_name(trajectory_id: str) -> str:
    return f"{trajectory_id}{DOCUMENT_SUFFIX}"


def sidecar_name(trajectory_id: str, kind: str) -> str:
    return f"{trajectory_id}.{kind}.zst"


def temp_name(final_name: str) -> str:
    """The sibling a file is written to before its rename (format.md §2): never listed."""
    return f".{final_name}.tmp"


def is_plain_name(name: object) -> bool:
    """Whether `name` names a visible file directly inside a directory, and nothing else.

    Ids and manifest file names come from requests and documents; this keeps them from
    reaching outside the record directory (`..`, `/`, `\\`, NUL) or onto temp files.
    """
    return (
        isinstance(name, str)
        and name != ""
        and not name.startswith(".")
        and not any(c in name for c in "/\\\0")
    )


def little_endian(dtype: Any, what: str) -> np.dtype:
    """The little-endian form of a whitelisted dtype; ValueError naming `what` otherwise."""
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise ValueError(
            f"{what}: dtype {dt.name} cannot be recorded (format.md §6.1 allows "
            f"{', '.join(DTYPES)}); cast it first"
        )
    return dt.newbyteorder("<")


def aligned(cursor: int) -> int:
    return -(-cursor // ALIGN) * ALIGN


class Column:
    """One payload array given as pieces written back to back along the first axis.

    Pieces are the graph's own per-node arrays (or views of them), so a payload is never
    concatenated in memory: the writer streams it piece by piece.
    """

    def __init__(
        self,
        name: str,
        dtype: Any,
        pieces: Sequence[np.ndarray],
        item_shape: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.dtype = little_endian(dtype, f"array {name}")
        self.pieces = pieces
        for piece in pieces:
            if piece.shape[1:] != item_shape:
                raise ValueError(
                    f"array {name}: a piece of shape {piece.shape} does not fit rows of "
                    f"shape {item_shape}"
                )
        self.shape = (sum(int(p.shape[0]) for p in pieces), *item_shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class Payload:
    """A sidecar payload: columns at 8-aligned offsets, no padding after the last.

    See format.md §6.1.
    """

    def __init__(self, columns: Sequence[Column]) -> None:
        self.columns = columns
        self.offsets: list[int] = []
        cursor = 0
        for column in columns:
            cursor = aligned(cursor)
            self.offsets.append(cursor)
            cursor += column.nbytes
        self.size = cursor

    def manifest(self, file: str) -> dict[str, Any]:
        return {
            "file": file,
            "arrays": {
                column.name: {
                    "dtype": column.dtype.name,
                    "shape": list(column.shape),
                    "offset": offset,
                }
                for column, offset in zip(self.columns, self.offsets, strict=True)
            },
        }

    def chunks(self) -> Iterator[bytes | np.ndarray]:
        """The payload's bytes in order, as padding and byte views of each piece."""
        cursor = 0
        for column, offset in zip(self.columns, self.offsets, strict=True):
            if offset > cursor:
                yield bytes(offset - cursor)
            for piece in column.pieces:
                data = np.ascontiguousarray(piece, dtype=column.dtype)
                if data.size:
                    yield data.reshape(-1).view(np.uint8)
            cursor = offset + column.nbytes

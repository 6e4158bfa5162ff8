"""Reading what an offline wandb run wrote: the artifact records of its `.wandb` file.

An offline run cannot be queried through wandb's API, so the tests read the run's
transaction log the way `wandb sync` would: a LevelDB-style log of 32 KiB blocks after a
7-byte header, each record a protobuf `Record`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, pieces = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        if pos + HEADER + length > len(data):  # a record still being written
            return
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pieces = chunk
        elif kind == MIDDLE:
            pieces += chunk
        elif kind == LAST:
            yield pieces + chunk


def logged_artifacts(run_dir: Path) -> list[dict[str, Any]]:
    """Each artifact the run logged, in order: name, type, aliases, entries (path -> ref)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = Path(run_dir).glob("*.wandb")
    found = []
    for raw in _records(log):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "artifact":
            continue
        artifact = record.artifact
        found.append(
            {
                "name": artifact.name,
                "type": artifact.type,
                "aliases": sorted(artifact.aliases),
                "entries": {e.path: e.ref for e in artifact.manifest.contents},
                "metadata": artifact.metadata,
            }
        )
    return found

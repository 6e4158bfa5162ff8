"""The record writer: sidecars then document, each one zstd frame (format.md §2)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import zstandard

from skycap.graph import Graph, Node
from skycap.record.layout import (
    FORMAT_VERSION,
    Payload,
    document_name,
    is_plain_name,
    sidecar_name,
    temp_name,
)
from skycap.record.sidecars import KINDS, REGISTRY
from skycap.record.tokens_kind import text_problem, warn_no_text
from skycap.trajectory import Trajectory

DecodeSpans = Callable[[list[int], list[int]], tuple[bytes, list[int]]]
# format.md §6.1: a node's text is decoded primed with its parent's last 8 tokens
CONTEXT_TOKENS = 8
LEVEL = 3
# One zstd worker thread compresses while this thread writes the file: the frame stays a
# single frame with its content size, and writing costs about what compressing does.
THREADS = 1


def write_record(
    trajectory: Trajectory, record_dir: Path, *, decode_spans: DecodeSpans | None = None
) -> list[str]:
    """Write the record of `trajectory` into `record_dir`; return the file names written.

    Synchronous and CPU-bound: the server runs it in a worker thread. Names come back
    sidecars first in kind order, document last (http.md §2.3). With `decode_spans`, token
    nodes without text are decoded first and keep their text (format.md §6.1).
    """
    if not is_plain_name(trajectory.id):
        raise ValueError(f"trajectory id {trajectory.id!r} cannot name a record file")
    record_dir = Path(record_dir)
    if decode_spans is not None:
        finalise_text(trajectory, decode_spans)
    builder = _SidecarBuilder(trajectory.id)
    tokens_objects = [builder.add(node) for node in trajectory.graph]
    payloads = builder.payloads()
    document = {"format_version": FORMAT_VERSION, **trajectory.document()}
    for entry, tokens in zip(document["nodes"], tokens_objects, strict=True):
        entry["tokens"] = tokens
    document["sidecars"] = {
        kind: payload.manifest(sidecar_name(trajectory.id, kind))
        for kind, payload in payloads.items()
    }
    # Serialise before touching the disk, so a document orjson refuses writes nothing.
    data = orjson.dumps(document)

    written = []
    for kind, payload in payloads.items():
        name = sidecar_name(trajectory.id, kind)
        _write_file(record_dir, name, payload.size, payload.chunks())
        written.append(name)
    if written:
        _fsync_dir(record_dir)  # the sidecars' names are durable before the document's
    name = document_name(trajectory.id)
    _write_file(record_dir, name, len(data), [data])
    _fsync_dir(record_dir)
    written.append(name)
    return written


def finalise_text(trajectory: Trajectory, decode_spans: DecodeSpans) -> None:
    """Decode every token node that has no text yet and keep what passes the format.md §6.1 checks.

    A node whose decoding raises or yields bad offsets keeps no text and is written
    without it (format.md §5); a later rewrite tries again.
    """
    graph = trajectory.graph
    for node in graph:
        tokens = node.tokens
        if tokens is None or tokens.text is not None:
            continue
        context = _context(graph, node)
        try:
            text, offsets = decode_spans(tokens.ids.tolist(), context)
            text = bytes(text)
            offsets = np.asarray(offsets, dtype=np.int32)
        except Exception as exc:  # a tokenizer can fail in many ways; the record must not
            warn_no_text(trajectory.id, node, f"decoding failed: {type(exc).__name__}: {exc}")
            continue
        problem = text_problem(tokens.length, text, offsets)
        if problem is not None:
            warn_no_text(trajectory.id, node, problem)
            continue
        tokens.text, tokens.text_offsets = text, offsets


def _context(graph: Graph, node: Node) -> list[int]:
    if node.parent is None:
        return []
    parent_tokens = graph[node.parent].tokens
    if parent_tokens is None:
        return []
    return parent_tokens.ids[-CONTEXT_TOKENS:].tolist()


class _SidecarBuilder:
    """Collects every token node's arrays as column pieces of each kind and assigns its
    slots (format.md §5): one collector per registered kind."""

    def __init__(self, trajectory_id: str) -> None:
        self.collectors = {name: REGISTRY[name].collector(trajectory_id) for name in KINDS}

    def add(self, node: Node) -> dict[str, Any] | None:
        """The node's `tokens` object (format.md §5, key order kept), its arrays queued."""
        tokens = node.tokens
        if tokens is None:
            return None
        entry: dict[str, Any] = {}
        for collector in self.collectors.values():
            entry.update(collector.add(node, tokens))
        entry["media"] = tokens.media
        return entry

    def payloads(self) -> dict[str, Payload]:
        """kind → payload for each kind that has data, in kind order (format.md §1)."""
        payloads = {}
        for kind, collector in self.collectors.items():
            columns = collector.columns()
            if columns is not None:
                payloads[kind] = Payload(columns)
        return payloads


def _write_file(
    record_dir: Path, name: str, size: int, chunks: Iterable[bytes | np.ndarray]
) -> None:
    """Stream `size` bytes into one zstd frame with its content size and content checksum
    (XXH64, verified by every zstd decoder) set (issue 17), then rename.

    The frame goes to `.{name}.tmp` and is fsynced before the rename, so the final name
    only ever holds a complete file; on any error the temp file is removed.
    """
    final = record_dir / name
    tmp = record_dir / temp_name(name)
    try:
        with open(tmp, "wb") as raw:
            compressor = zstandard.ZstdCompressor(
                level=LEVEL, threads=THREADS, write_content_size=True, write_checksum=True
            )
            stream = compressor.stream_writer(raw, size=size, closefd=False)
            for chunk in chunks:
                stream.write(chunk)
            stream.close()  # ends the frame; skipped on error, where ending it would raise
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

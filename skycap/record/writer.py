"""The record writer: sidecars then document, each one zstd frame (format.md §2)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import zstandard

from skycap.graph import Graph, Node, Tokens
from skycap.record.layout import (
    FORMAT_VERSION,
    Column,
    Payload,
    document_name,
    is_plain_name,
    little_endian,
    sidecar_name,
    temp_name,
)
from skycap.trajectory import Trajectory

logger = logging.getLogger(__name__)

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
            _warn_no_text(trajectory.id, node, f"decoding failed: {type(exc).__name__}: {exc}")
            continue
        problem = text_problem(tokens.length, text, offsets)
        if problem is not None:
            _warn_no_text(trajectory.id, node, problem)
            continue
        tokens.text, tokens.text_offsets = text, offsets


def text_problem(length: int, text: bytes, offsets: np.ndarray | None) -> str | None:
    """Why per-token text offsets cannot be written (format.md §6.1), or None."""
    if offsets is None:
        return "text without per-token offsets"
    if offsets.shape != (length,):
        return f"{offsets.size} text offsets for {length} tokens"
    if length == 0:
        return None
    if offsets[0] < 0:
        return f"first text offset {int(offsets[0])} is negative"
    if offsets[-1] > len(text):
        return f"last text offset {int(offsets[-1])} is past the text's {len(text)} bytes"
    if np.any(np.diff(offsets) < 0):
        return "text offsets decrease"
    return None


def _context(graph: Graph, node: Node) -> list[int]:
    if node.parent is None:
        return []
    parent_tokens = graph[node.parent].tokens
    if parent_tokens is None:
        return []
    return parent_tokens.ids[-CONTEXT_TOKENS:].tolist()


def _warn_no_text(trajectory_id: str, node: Node, reason: str) -> None:
    logger.warning("%s node %d: text not recorded: %s", trajectory_id, node.id, reason)


class _SidecarBuilder:
    """Collects every token node's arrays as column pieces and assigns its slots (format.md §5)."""

    def __init__(self, trajectory_id: str) -> None:
        self.trajectory_id = trajectory_id
        self.has_tokens = False
        self.ids: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []
        self.text_offsets: list[np.ndarray] = []
        self.text: list[np.ndarray] = []
        self.experts: list[np.ndarray] = []
        self.experts_dtype: np.dtype | None = None
        self.mask_ids: list[np.ndarray] = []
        self.mask_offsets: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self.token_cursor = 0
        self.text_cursor = 0
        self.experts_cursor = 0
        self.mask_row_cursor = 0
        self.mask_id_cursor = 0
        # Shared fill values, sliced per node instead of allocated per node.
        self._nan = np.empty(0, dtype=np.float64)
        self._zeros = np.empty(0, dtype=np.int32)

    def add(self, node: Node) -> dict[str, Any] | None:
        """The node's `tokens` object (format.md §5, key order kept), its arrays queued."""
        tokens = node.tokens
        if tokens is None:
            return None
        self.has_tokens = True
        length = tokens.length
        entry = {
            "offset": self.token_cursor,
            "length": length,
            "sampled_start": None if tokens.sampled_start is None else int(tokens.sampled_start),
            "has_logprobs": self._add_logprobs(node, tokens),
            **self._add_text(node, tokens),
            **self._add_experts(node, tokens),
            **self._add_mask(node, tokens),
            "media": tokens.media,
        }
        self.ids.append(tokens.ids)
        self.token_cursor += length
        return entry

    def _add_logprobs(self, node: Node, tokens: Tokens) -> bool:
        if tokens.logprobs is None:
            self.logprobs.append(self._fill_nan(tokens.length))
            return False
        if tokens.logprobs.shape != (tokens.length,):
            raise ValueError(
                f"node {node.id}: logprobs of shape {tokens.logprobs.shape} for "
                f"{tokens.length} tokens"
            )
        self.logprobs.append(tokens.logprobs)
        return True

    def _add_text(self, node: Node, tokens: Tokens) -> dict[str, Any]:
        if tokens.text is None:
            self.text_offsets.append(self._fill_zeros(tokens.length))
            return {"text_offset": None, "text_bytes": 0}
        offsets = None if tokens.text_offsets is None else np.asarray(tokens.text_offsets)
        problem = text_problem(tokens.length, tokens.text, offsets)
        if problem is not None:
            _warn_no_text(self.trajectory_id, node, problem)
            self.text_offsets.append(self._fill_zeros(tokens.length))
            return {"text_offset": None, "text_bytes": 0}
        entry = {"text_offset": self.text_cursor, "text_bytes": len(tokens.text)}
        self.text_offsets.append(offsets)
        self.text.append(np.frombuffer(tokens.text, dtype=np.uint8))
        self.text_cursor += len(tokens.text)
        return entry

    def _add_experts(self, node: Node, tokens: Tokens) -> dict[str, Any]:
        experts = tokens.experts
        if experts is None:
            return {"experts_offset": None, "experts_rows": 0}
        if experts.ndim != 3 or experts.shape[0] != tokens.length:
            raise ValueError(
                f"node {node.id}: routed experts of shape {experts.shape} for "
                f"{tokens.length} tokens; expected [{tokens.length}, layers, k]"
            )
        if self.experts_dtype is None:
            # The first array fixes the column's dtype and (layers, k); later ones cast.
            self.experts_dtype = little_endian(experts.dtype, f"node {node.id} routed experts")
        elif experts.shape[1:] != self.experts[0].shape[1:]:
            raise ValueError(
                f"node {node.id}: routed experts (layers, k) = {experts.shape[1:]} differ "
                f"from the first node's {self.experts[0].shape[1:]}"
            )
        entry = {"experts_offset": self.experts_cursor, "experts_rows": tokens.length}
        self.experts.append(experts)
        self.experts_cursor += tokens.length
        return entry

    def _add_mask(self, node: Node, tokens: Tokens) -> dict[str, Any]:
        bounds = tokens.mask_offsets
        if bounds is None:
            return {"mask_offset": None, "mask_rows": 0}
        if (
            bounds.ndim != 1
            or bounds.shape[0] < 1
            or bounds[0] < 0
            or bounds[-1] > tokens.mask_ids.shape[0]
            or np.any(np.diff(bounds) < 0)
        ):
            raise ValueError(
                f"node {node.id}: sampling-mask offsets {bounds.tolist()} are not CSR bounds "
                f"over {tokens.mask_ids.shape[0]} ids"
            )
        rows = tokens.mask_rows
        entry = {"mask_offset": self.mask_row_cursor, "mask_rows": rows}
        if rows:
            start, end = int(bounds[0]), int(bounds[-1])
            self.mask_ids.append(tokens.mask_ids[start:end])
            self.mask_offsets.append(bounds[1:] - start + self.mask_id_cursor)
            self.mask_id_cursor += end - start
            self.mask_row_cursor += rows
        return entry

    def payloads(self) -> dict[str, Payload]:
        """kind → payload for each kind that has data, in kind order (format.md §1)."""
        payloads = {}
        if self.has_tokens:
            payloads["tokens"] = Payload(
                [
                    Column("token_ids", np.int32, self.ids),
                    Column("logprobs", np.float64, self.logprobs),
                    Column("text_offsets", np.int32, self.text_offsets),
                    Column("text", np.uint8, self.text),
                ]
            )
        if self.experts_dtype is not None:
            item_shape = tuple(int(n) for n in self.experts[0].shape[1:])
            payloads["experts"] = Payload(
                [Column("routed_experts", self.experts_dtype, self.experts, item_shape)]
            )
        if self.mask_row_cursor > 0:  # an all-empty mask writes no sidecar (format.md §7)
            payloads["sampling_mask"] = Payload(
                [
                    Column("ids", np.int32, self.mask_ids),
                    Column("offsets", np.int64, self.mask_offsets),
                ]
            )
        return payloads

    def _fill_nan(self, length: int) -> np.ndarray:
        if self._nan.shape[0] < length:
            self._nan = np.full(max(length, 2 * self._nan.shape[0]), np.nan)
        return self._nan[:length]

    def _fill_zeros(self, length: int) -> np.ndarray:
        if self._zeros.shape[0] < length:
            self._zeros = np.zeros(max(length, 2 * self._zeros.shape[0]), dtype=np.int32)
        return self._zeros[:length]


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

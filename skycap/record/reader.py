"""The record reader: documents, manifest-driven sidecars, records loaded back (format.md §3)."""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import zstandard

from skycap.graph import Graph, Tokens
from skycap.record.frames import FrameError, content_size_problem, zstd_frames
from skycap.record.layout import (
    DOCUMENT_SUFFIX,
    DTYPES,
    FORMAT_VERSION,
    RecordError,
    document_name,
    is_plain_name,
)
from skycap.record.sidecar_kind import NodeFields
from skycap.record.sidecars import KINDS, REGISTRY
from skycap.trajectory import OPEN, STATUSES, Trajectory

# The first record rule of docs/viewer.md "skycap validate": what a document must hold to be read at
# all.
REQUIRED_FIELDS = ("id", "status", "nodes", "sidecars")
NODE_FIELDS = ("parent", "author", "message", "match_hash", "delta_hash", "created_at", "calls")


def record_ids(record_dir: Path) -> list[str]:
    """Ids of the documents at the top level of `record_dir`, sorted by file name (format.md §3)."""
    directory = Path(record_dir)
    if not directory.is_dir():
        raise RecordError(f"record dir {directory} is not a directory")
    names = sorted(
        path.name
        for path in directory.glob("*" + DOCUMENT_SUFFIX)
        if not path.name.startswith(".") and path.is_file()
    )
    return [name[: -len(DOCUMENT_SUFFIX)] for name in names]


def document_path(record_dir: Path, trajectory_id: str) -> Path:
    """Where the document of `trajectory_id` lies; refuses ids that could leave the directory."""
    if not is_plain_name(trajectory_id):
        raise RecordError(
            f"trajectory id {trajectory_id!r} is not a plain file name "
            "(ids look like tr_3f9a0c2b7d1e4a55)"
        )
    return Path(record_dir) / document_name(trajectory_id)


def read_document(path: Path) -> dict[str, Any]:
    """The document at `path`, checked for the fields and version every reader needs."""
    raw = decompress_file(Path(path))
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RecordError(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(document, dict):
        raise RecordError(f"the document is a JSON {_json_type(document)}, not an object")
    if "format_version" not in document:
        raise RecordError("missing format_version")
    version = document["format_version"]
    if type(version) is not int or version != FORMAT_VERSION:
        raise RecordError(
            f"format_version {orjson.dumps(version).decode()}, this skycap reads {FORMAT_VERSION}"
        )
    for field in REQUIRED_FIELDS:
        if field not in document:
            raise RecordError(f"missing {field}")
    _check_type(document, "id", str)
    _check_type(document, "nodes", list)
    _check_type(document, "sidecars", dict)
    if document["status"] not in STATUSES:
        raise RecordError(
            f"unknown status {orjson.dumps(document['status']).decode()} "
            f"(expected one of {', '.join(STATUSES)})"
        )
    return document


def read_sidecar(
    record_dir: Path, document: dict[str, Any], kind: str
) -> dict[str, np.ndarray] | None:
    """The arrays of sidecar `kind` by name, or None when the record does not have it.

    The manifest decides (format.md §3): a kind it does not list, a kind in `omitted_sidecars`, and
    a listed file that is not beside the document all read as absent. Arrays are
    read-only views of one decompressed buffer.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown sidecar kind {kind!r}; known kinds: {', '.join(KINDS)}")
    omitted = document.get("omitted_sidecars", [])
    if not isinstance(omitted, list):
        raise RecordError(f"omitted_sidecars must be an array, got {_json_type(omitted)}")
    entry = document["sidecars"].get(kind)
    if kind in omitted or entry is None:
        return None
    file, arrays = _manifest_entry(kind, entry)
    path = Path(record_dir) / file
    if not path.is_file():
        return None
    payload = decompress_file(path)
    return {name: _array(payload, kind, name, spec) for name, spec in arrays.items()}


def load_trajectory(record_dir: Path, trajectory_id: str, *, sidecars: bool = True) -> Trajectory:
    """The recorded trajectory, its graph rebuilt with `Graph.add` so node ids come back equal.

    Nodes get their Tokens from the sidecars; a sidecar that is absent leaves those parts
    None (no tokens at all without the tokens sidecar), as does `sidecars=False`. Rewrite a
    record only from a trajectory loaded with its sidecars.
    """
    document = record_document(record_dir, trajectory_id)
    return trajectory_from_document(record_dir, document, sidecars=sidecars)


def record_document(record_dir: Path, trajectory_id: str) -> dict[str, Any]:
    """The document of record `trajectory_id`, refused if it holds another trajectory."""
    path = document_path(record_dir, trajectory_id)
    document = read_document(path)
    if document["id"] != trajectory_id:
        raise RecordError(f"{path} holds trajectory {document['id']!r}, not {trajectory_id!r}")
    return document


def trajectory_from_document(
    record_dir: Path, document: dict[str, Any], *, sidecars: bool = True
) -> Trajectory:
    """The second half of `load_trajectory`, for a caller that also needs the document."""
    trajectory = _trajectory(document)
    arrays = _Sidecars(Path(record_dir), document) if sidecars else None
    for index, entry in enumerate(document["nodes"]):
        _add_node(trajectory.graph, index, entry, arrays)
    return trajectory


def decompress_file(path: Path) -> bytes:
    """The content of the single zstd frame in `path` (a second frame is an error).

    The file is mapped, not read, so reading a sidecar holds little more than its content.
    """
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size == 0:
                raise RecordError(f"{path} has 0 zstd frames (format.md: one)")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _decompress_frame(data, path)
    except OSError as exc:
        raise RecordError(f"cannot read {path}: {exc.strerror or exc}") from None


def _decompress_frame(data: mmap.mmap, path: Path) -> bytes:
    try:
        frames = zstd_frames(data)
    except FrameError as exc:
        raise RecordError(f"ZstdError: {path.name}: {exc}") from None
    if len(frames) != 1:
        raise RecordError(f"{path} has {len(frames)} zstd frames (format.md: one)")
    start, end = frames[0]
    decompressor = zstandard.ZstdDecompressor()
    with memoryview(data) as whole, whole[start:end] as frame:
        try:
            problem = content_size_problem(frame)
            if problem is not None:
                raise RecordError(f"ZstdError: {path.name}: {problem}")
            if zstandard.frame_content_size(frame) >= 0:
                return decompressor.decompress(frame)
            # Another writer left the content size out: still one frame, so stream it.
            return decompressor.decompressobj().decompress(frame)
        except zstandard.ZstdError as exc:
            # A content checksum that does not match lands here too (issue 17).
            raise RecordError(f"ZstdError: {path.name}: corrupt zstd frame: {exc}") from None
        except MemoryError:
            raise RecordError(
                f"{path.name}: its zstd frame claims more content than this process can hold"
            ) from None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {dict: "object", list: "list", str: "string", type(None): "null"}[type(value)]


def _check_type(document: dict[str, Any], field: str, kind: type) -> None:
    if not isinstance(document[field], kind):
        expected = {str: "string", list: "array", dict: "object"}[kind]
        raise RecordError(f"{field} must be a JSON {expected}, got {_json_type(document[field])}")


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _manifest_entry(kind: str, entry: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(entry, dict) or not isinstance(entry.get("arrays"), dict):
        raise RecordError(f"sidecars.{kind} must be an object with an arrays object")
    file = entry.get("file")
    if not is_plain_name(file):
        raise RecordError(f"sidecars.{kind}.file {file!r} is not a plain file name")
    return file, entry["arrays"]


def _array(payload: bytes, kind: str, name: str, spec: Any) -> np.ndarray:
    """Array `name` of the payload: prod(shape) little-endian items from byte `offset`."""
    what = f"{kind} array {name}"
    if not isinstance(spec, dict):
        raise RecordError(f"{what}: manifest entry must be an object")
    dtype, shape, offset = spec.get("dtype"), spec.get("shape"), spec.get("offset")
    if dtype not in DTYPES:
        raise RecordError(f"{what}: unknown dtype {dtype!r} (format.md §6.1: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise RecordError(f"{what}: bad shape {shape!r}")
    if not _is_count(offset):
        raise RecordError(f"{what}: bad offset {offset!r}")
    item = np.dtype(dtype).newbyteorder("<")
    count = math.prod(shape)  # Python ints: a hostile shape like [2**62, 4, 2] cannot wrap
    end = offset + count * item.itemsize
    if end > len(payload):
        raise RecordError(
            f"{what} of shape {shape} needs payload bytes [{offset}, {end}) but the "
            f"{kind} payload has {len(payload)} bytes"
        )
    return np.frombuffer(payload, dtype=item, count=count, offset=offset).reshape(shape)


class _Sidecars:
    """Each sidecar of one record, opened the first time a node needs it."""

    def __init__(self, record_dir: Path, document: dict[str, Any]) -> None:
        self.record_dir = record_dir
        self.document = document
        self._read: dict[str, dict[str, np.ndarray] | None] = {}

    def get(self, kind: str) -> dict[str, np.ndarray] | None:
        if kind not in self._read:
            arrays = read_sidecar(self.record_dir, self.document, kind)
            for name in REGISTRY[kind].arrays if arrays is not None else ():
                if name not in arrays:
                    raise RecordError(f"the {kind} sidecar lists no array {name}")
            self._read[kind] = arrays
        return self._read[kind]


def _trajectory(document: dict[str, Any]) -> Trajectory:
    for field in ("capture", "created_at"):
        if field not in document:
            raise RecordError(f"missing {field}")
    trajectory = Trajectory(
        document["id"],
        capture=document["capture"],
        meta=document.get("meta") or {},
        created_at=document["created_at"],
        provenance=document.get("provenance"),
    )
    trajectory.status = document["status"]
    ended = document.get("ended")
    # Older records have no `ended`: such a record is ended iff its status is not open
    # (format.md §3).
    trajectory.ended = ended if isinstance(ended, bool) else trajectory.status != OPEN
    trajectory.annotations = document.get("annotations") or {}
    trajectory.finished_at = document.get("finished_at")
    trajectory.tools = document.get("tools") or {}
    trajectory.failures = document.get("failures") or []
    trajectory.retries = document.get("retries") or {"replayed": 0, "coalesced": 0}
    samples = document.get("samples")
    if samples is not None and not (
        isinstance(samples, dict) and isinstance(samples.get("rows"), list)
    ):
        raise RecordError("samples must be null or an object with a rows array")
    trajectory.samples = samples
    return trajectory


def _add_node(graph: Graph, index: int, entry: Any, arrays: _Sidecars | None) -> None:
    if not isinstance(entry, dict):
        raise RecordError(f"nodes[{index}] is a JSON {_json_type(entry)}, not an object")
    if entry.get("id") != index:
        raise RecordError(f"nodes[{index}].id is {entry.get('id')!r}")
    for field in NODE_FIELDS:
        if field not in entry:
            raise RecordError(f"node {index}: missing {field}")
    parent = entry["parent"]
    if parent is not None and not (type(parent) is int and 0 <= parent < index):
        raise RecordError(f"node {index} has parent {parent!r}, not an earlier node")
    if not isinstance(entry["message"], dict) or not isinstance(entry["calls"], list):
        raise RecordError(f"node {index}: message must be an object and calls an array")
    tokens = entry.get("tokens")
    try:
        node = graph.add(
            parent,
            author=entry["author"],
            message=entry["message"],
            match_hash=entry["match_hash"],
            delta_hash=entry["delta_hash"],
            created_at=entry["created_at"],
            tokens=None if tokens is None or arrays is None else _tokens(index, tokens, arrays),
        )
    except ValueError as exc:
        raise RecordError(f"node {index}: {exc}") from None
    if node.id != index:
        raise RecordError(f"node {index} repeats node {node.id} (same parent and delta_hash)")
    node.calls = list(entry["calls"])  # calls without `bridged` keep it absent (format.md §3)


def _tokens(index: int, spec: Any, arrays: _Sidecars) -> Tokens | None:
    """The node's Tokens from its slices; None without the tokens sidecar (message text only)."""
    if not isinstance(spec, dict):
        raise RecordError(f"node {index}: tokens must be an object or null")
    if arrays.get("tokens") is None:
        return None
    fields = NodeFields(index, spec)
    values: dict[str, Any] = {}
    extra: dict[str, np.ndarray] = {}
    for name in KINDS:
        kind = REGISTRY[name]
        loaded = kind.load(fields, lambda name=name: arrays.get(name))
        if kind.own:
            values.update(loaded)
        else:
            extra.update((k, v) for k, v in loaded.items() if v is not None)
    return Tokens(**values, media=list(spec.get("media") or []), extra=extra or None)

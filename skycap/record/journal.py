"""The crash journal: a line per committed call, so a killed server loses only calls in flight.

Each open trajectory with a record directory has `<record dir>/.journal/<id>.jsonl` and,
in token mode, `<id>.bin` beside it. The first line names the trajectory (id, capture,
meta, created_at); each later line is what one committed call changed: the nodes it
added (message, hashes, calls, and their token arrays as references into the `.bin`
file), calls it added to nodes already journaled, expert rows it filled in, new tools,
new failures and the retry counters. Arrays are appended to `.bin` before the line that
names them, so a line never points past what was written; a line cut off by a crash is
ignored on replay. Readers skip the directory (dot-names, format.md §3).

The journal is written on the event loop before the harness gets its answer, unsynced
unless `fsync` (power loss, not just a killed process). `replay_journals` turns every
journal whose record is missing back into a trajectory and writes its record as a
shutdown would (`ended: false`: it can be finished, takes no calls); it is a plain
function so a supervisor process can run it once for all its workers.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from skycap.graph import Graph, Node, Tokens
from skycap.record.layout import document_name, is_plain_name
from skycap.record.sidecars import REGISTRY
from skycap.record.writer import write_record
from skycap.trajectory import Trajectory

logger = logging.getLogger("skycap.journal")

JOURNAL_DIR = ".journal"
JOURNAL_VERSION = 1
RECOVERED = (
    "the server stopped without writing this record; it was rebuilt from the crash journal "
    "(a call in flight at that moment is not in it)"
)


class JournalError(ValueError):
    """A journal that cannot be replayed at all (no readable first line)."""


@dataclass(slots=True)
class _Cursor:
    """What the journal already holds of one trajectory, so each line is only what is new."""

    #: Its (lines, arrays) files, named once: a path built per call is a cost per call.
    paths: tuple[Path, Path]
    nodes: int = 0
    calls: int = 0
    node_calls: dict[int, int] = field(default_factory=dict)
    placeholders: set[int] = field(default_factory=set)
    tools: int = 0
    failures: int = 0
    bin_size: int = 0
    # A write failed (a full disk): the next append rewrites the whole journal.
    broken: bool = False


def journal_dir(record_dir: Path) -> Path:
    return Path(record_dir) / JOURNAL_DIR


def _lock_path(directory: Path, instance: str) -> Path:
    return directory / f".server-{instance}.lock"


def _server_alive(directory: Path, instance: Any) -> bool:
    """Whether the server that wrote a journal still runs (holds its lock file)."""
    if not isinstance(instance, str) or not instance.isalnum():
        return False
    try:
        fd = os.open(_lock_path(directory, instance), os.O_WRONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    _lock_path(directory, instance).unlink(missing_ok=True)
    return False


def journal_paths(record_dir: Path, trajectory_id: str) -> tuple[Path, Path]:
    """(lines, arrays) files of one trajectory's journal."""
    directory = journal_dir(record_dir)
    return directory / f"{trajectory_id}.jsonl", directory / f"{trajectory_id}.bin"


class Journal:
    """The journals one server writes into a record directory; methods run on its event loop.

    The server holds a lock file (`.journal/.server-<instance>.lock`) while it runs, and
    each journal's first line names the instance: a replay skips journals whose server
    still holds its lock, so servers sharing a record directory never replay each other's
    open trajectories.
    """

    def __init__(self, record_dir: Path, *, fsync: bool = False) -> None:
        self.record_dir = Path(record_dir)
        self.directory = journal_dir(self.record_dir)
        self.fsync = fsync
        self.instance = uuid.uuid4().hex
        self._cursors: dict[str, _Cursor] = {}
        self.directory.mkdir(exist_ok=True)
        self._lock_path = _lock_path(self.directory, self.instance)
        self._lock = os.open(self._lock_path, os.O_WRONLY | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def close(self) -> None:
        """Release the server's lock (its journals left behind become replayable)."""
        if self._lock >= 0:
            self._lock_path.unlink(missing_ok=True)
            os.close(self._lock)
            self._lock = -1

    def open(self, trajectory: Trajectory) -> None:
        """Start the journal of a new trajectory with its first line (OSError if unwritable)."""
        if not is_plain_name(trajectory.id):
            raise ValueError(f"trajectory id {trajectory.id!r} cannot name a journal file")
        self.directory.mkdir(exist_ok=True)
        lines, arrays = journal_paths(self.record_dir, trajectory.id)
        head = {
            "journal": JOURNAL_VERSION,
            "server": self.instance,
            "id": trajectory.id,
            "capture": trajectory.capture,
            "provenance": trajectory.provenance,
            "meta": trajectory.meta,
            "created_at": trajectory.created_at,
        }
        cursor = self._cursors[trajectory.id] = _Cursor((lines, arrays), broken=True)
        self._write(lines, orjson.dumps(head) + b"\n", truncate=True)
        arrays.unlink(missing_ok=True)
        self._sync_directory()
        cursor.broken = False

    def _sync_directory(self) -> None:
        """With `fsync`, a new journal file's name must survive a power loss too."""
        if self.fsync:
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def broken(self, trajectory_id: str) -> bool:
        """Whether the last write of this journal failed (it is rewritten whole next time)."""
        cursor = self._cursors.get(trajectory_id)
        return cursor is not None and cursor.broken

    def append(self, trajectory: Trajectory, calls: int) -> None:
        """Journal what the last commit changed; `calls` is the trajectory's call count now.

        After a failed write (OSError, e.g. a full disk) the next append rewrites the
        journal whole, so a journal never misses a line once the disk has room again. A
        trajectory this journal did not open (adopted from disk) is not journaled: its
        record already exists.
        """
        cursor = self._cursors.get(trajectory.id)
        if cursor is None:
            return
        if cursor.broken:
            self.open(trajectory)
            cursor = self._cursors[trajectory.id]
            cursor.broken = True
        lines, arrays = cursor.paths
        blobs = _Blobs()
        line = _delta(trajectory, cursor, calls, blobs)
        try:
            if blobs.parts:
                self._write(arrays, *blobs.parts)
                if cursor.bin_size == 0:
                    self._sync_directory()
                cursor.bin_size += blobs.size
            self._write(lines, orjson.dumps(line, option=orjson.OPT_NON_STR_KEYS) + b"\n")
        except BaseException:
            cursor.broken = True
            raise
        cursor.broken = False

    def remove(self, trajectory_id: str) -> None:
        """Drop a journal once its record is written (a missing one is fine)."""
        self._cursors.pop(trajectory_id, None)
        if not is_plain_name(trajectory_id):
            return
        for path in journal_paths(self.record_dir, trajectory_id):
            path.unlink(missing_ok=True)

    def _write(self, path: Path, *parts: Any, truncate: bool = False) -> None:
        """Append `parts` (bytes or byte views of arrays, never copied) to `path`."""
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else os.O_APPEND)
        fd = os.open(path, flags, 0o600)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


class _Blobs:
    """Array bytes queued for one line's `.bin` append, as zero-copy views."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.size = 0


def _delta(trajectory: Trajectory, cursor: _Cursor, calls: int, blobs: _Blobs) -> dict:
    """One line: what changed since the cursor, the cursor moved past it."""
    graph = trajectory.graph
    line: dict[str, Any] = {"status": trajectory.status, "retries": trajectory.retries}
    new = graph.nodes[cursor.nodes :]
    if new:
        line["nodes"] = [_node_entry(node, cursor, blobs) for node in new]
    added = sum(len(node.calls) for node in new)
    for node in new:
        if node.calls:
            cursor.node_calls[node.id] = len(node.calls)
    cursor.nodes = len(graph)
    if cursor.calls + added < calls:  # a call joined a node already journaled
        grown = {}
        for node_id, seen in cursor.node_calls.items():
            now = graph[node_id].calls
            if len(now) > seen:
                grown[node_id] = now[seen:]
                cursor.node_calls[node_id] = len(now)
        line["calls"] = grown
    cursor.calls = calls
    filled = {}
    for node_id in list(cursor.placeholders):
        tokens = graph[node_id].tokens
        if tokens is not None and not tokens.experts_placeholder and tokens.experts is not None:
            filled[node_id] = _ref(tokens.experts[-1], cursor, blobs)
            cursor.placeholders.discard(node_id)
    if filled:
        line["expert_rows"] = filled
    if len(trajectory.tools) > cursor.tools:
        line["tools"] = dict(list(trajectory.tools.items())[cursor.tools :])
        cursor.tools = len(trajectory.tools)
    if len(trajectory.failures) > cursor.failures:
        line["failures"] = trajectory.failures[cursor.failures :]
        cursor.failures = len(trajectory.failures)
    return line


def _node_entry(node: Node, cursor: _Cursor, blobs: _Blobs) -> dict[str, Any]:
    entry = {
        "id": node.id,
        "parent": node.parent,
        "author": node.author,
        "message": node.message,
        "match_hash": node.match_hash,
        "delta_hash": node.delta_hash,
        "created_at": node.created_at,
        "calls": node.calls,
        "tokens": None,
    }
    tokens = node.tokens
    if tokens is not None:
        spec: dict[str, Any] = {
            "sampled_start": tokens.sampled_start,
            "media": tokens.media,
            "experts_placeholder": tokens.experts_placeholder,
            "text": None if tokens.text is None else _ref(tokens.text, cursor, blobs),
        }
        for kind in REGISTRY.values():
            for name in kind.fields:
                array = kind.get(tokens, name)
                spec[name] = None if array is None else _ref(array, cursor, blobs)
        entry["tokens"] = spec
        if tokens.experts_placeholder:
            cursor.placeholders.add(node.id)
    return entry


def _ref(value: np.ndarray | bytes, cursor: _Cursor, blobs: _Blobs) -> dict[str, Any]:
    """Queue an array's bytes for the `.bin` file; the reference the line carries."""
    if isinstance(value, bytes):
        array = np.frombuffer(value, dtype=np.uint8)
    else:
        array = np.ascontiguousarray(value)
        array = array.astype(array.dtype.newbyteorder("<"), copy=False)
    at = cursor.bin_size + blobs.size
    if array.nbytes:
        blobs.parts.append(array.reshape(-1).view(np.uint8))
        blobs.size += array.nbytes
    return {"dtype": array.dtype.str, "shape": list(array.shape), "at": at}


# -- replay --------------------------------------------------------------------------------


@dataclass
class Replayed:
    """What `replay_journals` did: records written, trajectories it could not write, and
    journals it could not read (each with why)."""

    written: list[str] = field(default_factory=list)
    unwritten: list[Trajectory] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)


Write = Callable[[Trajectory], object]


def pending_journals(record_dir: Path) -> list[str]:
    """Ids with a journal; a journal whose record exists is removed here (its record was
    written and the process stopped before removing it)."""
    directory = journal_dir(record_dir)
    if not directory.is_dir():
        return []
    ids = []
    for path in sorted(directory.glob("*.jsonl")):
        trajectory_id = path.name[: -len(".jsonl")]
        if not is_plain_name(trajectory_id):
            continue
        if _server_alive(directory, _head(path).get("server")):
            continue
        if (Path(record_dir) / document_name(trajectory_id)).is_file():
            for stale in journal_paths(record_dir, trajectory_id):
                stale.unlink(missing_ok=True)
            continue
        ids.append(trajectory_id)
    return ids


def _head(path: Path) -> dict[str, Any]:
    """A journal's first line, or {} when it cannot be read."""
    try:
        with open(path, "rb") as file:
            head = orjson.loads(file.readline())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return head if isinstance(head, dict) else {}


def replay_journals(record_dir: Path, write: Write | None = None) -> Replayed:
    """Rebuild each journal without a record and `write` its record, then drop the journal.

    `write(trajectory)` writes the record: by default `write_record` into `record_dir`
    (token nodes then carry no decoded text, which the format allows); a server passes
    its own, with its tokenizer's text decoding. When it raises, the trajectory is
    returned in `unwritten` and its journal kept. Synchronous: a server runs it before it
    serves, a supervisor once before it starts its workers.
    """
    if write is None:

        def write(trajectory: Trajectory) -> None:
            write_record(trajectory, record_dir)

    result = Replayed()
    for trajectory_id in pending_journals(record_dir):
        try:
            trajectory = read_journal(record_dir, trajectory_id)
        except (JournalError, OSError) as exc:
            logger.error("the crash journal of %s cannot be replayed: %s", trajectory_id, exc)
            result.unreadable[trajectory_id] = str(exc)
            continue
        try:
            write(trajectory)
        except Exception as exc:
            logger.error(
                "the record of %s, rebuilt from its crash journal, cannot be written into "
                "%s: %s: %s",
                trajectory_id,
                record_dir,
                type(exc).__name__,
                exc,
            )
            result.unwritten.append(trajectory)
            continue
        for path in journal_paths(record_dir, trajectory_id):
            path.unlink(missing_ok=True)
        result.written.append(trajectory_id)
    if result.written:
        logger.warning(
            "rebuilt %d trajectories from crash journals in %s (they take no more calls and "
            "can be finished)",
            len(result.written),
            record_dir,
        )
        logger.info("rebuilt from crash journals: %s", ", ".join(result.written))
    return result


def read_journal(record_dir: Path, trajectory_id: str) -> Trajectory:
    """The trajectory a journal describes, up to its last whole line; ends `ended: false`."""
    lines_path, arrays_path = journal_paths(record_dir, trajectory_id)
    raw = lines_path.read_bytes()
    blob = arrays_path.read_bytes() if arrays_path.is_file() else b""
    lines = raw.split(b"\n")
    try:
        head = orjson.loads(lines[0])
    except orjson.JSONDecodeError as exc:
        raise JournalError(f"{lines_path.name}: first line is not JSON: {exc}") from None
    if not isinstance(head, dict) or head.get("journal") != JOURNAL_VERSION:
        raise JournalError(f"{lines_path.name}: not a version {JOURNAL_VERSION} journal")
    if head.get("id") != trajectory_id:
        raise JournalError(f"{lines_path.name} holds trajectory {head.get('id')!r}")
    trajectory = Trajectory(
        trajectory_id,
        capture=head.get("capture") or {"mode": "text"},
        meta=head.get("meta") or {},
        created_at=head.get("created_at") or time.time(),
        provenance=head.get("provenance"),
    )
    for number, text in enumerate(lines[1:], start=2):
        if not text:
            continue
        try:
            _apply(trajectory, orjson.loads(text), blob)
        except (orjson.JSONDecodeError, _Torn) as exc:
            # The line a crash cut off, or one whose arrays never reached the disk.
            logger.info("%s line %d not replayed: %s", lines_path.name, number, exc)
            break
    trajectory.add_failure(None, RECOVERED)
    return trajectory


class _Torn(ValueError):
    """A journal line that does not fit what came before (a crash mid-write)."""


def _apply(trajectory: Trajectory, line: Any, blob: bytes) -> None:
    if not isinstance(line, dict):
        raise _Torn("not an object")
    graph = trajectory.graph
    # Check every array reference before changing anything, so a torn line applies none.
    nodes = [_node_from_entry(entry, blob) for entry in line.get("nodes") or []]
    rows = {int(k): _array(v, blob) for k, v in (line.get("expert_rows") or {}).items()}
    for entry, tokens in nodes:
        _add(graph, entry, tokens)
    for node_id, calls in (line.get("calls") or {}).items():
        graph[int(node_id)].calls.extend(calls)
    for node_id, row in rows.items():
        tokens = graph[node_id].tokens
        if tokens is not None and tokens.experts is not None:
            tokens.experts = tokens.experts.copy()
            tokens.experts[-1] = row
            tokens.experts_placeholder = False
    trajectory.tools.update(line.get("tools") or {})
    trajectory.failures.extend(line.get("failures") or [])
    if isinstance(line.get("retries"), dict):
        trajectory.retries = line["retries"]
    if isinstance(line.get("status"), str):
        trajectory.status = line["status"]


def _node_from_entry(entry: Any, blob: bytes) -> tuple[dict[str, Any], Tokens | None]:
    if not isinstance(entry, dict):
        raise _Torn("a node entry is not an object")
    spec = entry.get("tokens")
    if spec is None:
        return entry, None
    values: dict[str, Any] = {}
    extra: dict[str, np.ndarray] = {}
    for kind in REGISTRY.values():
        for name in kind.fields:
            array = _array(spec.get(name), blob)
            if kind.own:
                values[name] = array
            elif array is not None:
                extra[name] = array
    if values["ids"] is None:
        raise _Torn("a token node without ids")
    text = _array(spec.get("text"), blob)
    tokens = Tokens(
        **values,
        sampled_start=spec.get("sampled_start"),
        media=list(spec.get("media") or []),
        text=None if text is None else text.tobytes(),
        experts_placeholder=bool(spec.get("experts_placeholder")),
        extra=extra or None,
    )
    return entry, tokens


def _add(graph: Graph, entry: dict[str, Any], tokens: Tokens | None) -> None:
    try:
        node = graph.add(
            entry["parent"],
            author=entry["author"],
            message=entry["message"],
            match_hash=entry["match_hash"],
            delta_hash=entry["delta_hash"],
            created_at=entry["created_at"],
            tokens=tokens,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _Torn(f"node {entry.get('id')!r}: {exc}") from None
    if node.id != entry.get("id"):
        raise _Torn(f"node {entry.get('id')!r} came back as node {node.id}")
    node.calls = list(entry.get("calls") or [])


def _array(ref: Any, blob: bytes) -> np.ndarray | None:
    if ref is None:
        return None
    try:
        dtype = np.dtype(ref["dtype"])
        shape = [int(n) for n in ref["shape"]]
        at = int(ref["at"])
        count = math.prod(shape)
    except (KeyError, TypeError, ValueError) as exc:
        raise _Torn(f"bad array reference {ref!r}: {exc}") from None
    end = at + count * dtype.itemsize
    if at < 0 or count < 0 or end > len(blob):
        raise _Torn(f"array bytes [{at}, {end}) are past the {len(blob)}-byte array file")
    # A copy: the replayed trajectory owns writable arrays, as a live one does.
    return np.frombuffer(blob, dtype=dtype, count=count, offset=at).reshape(shape).copy()

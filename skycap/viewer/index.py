"""Runs for the viewer: record directories found under the given folders, and a cached summary
per document, rescanned incrementally (docs/viewer.md "Running it").

A rescan lists each directory once, re-reads only documents whose modification time or
size changed (or whose listed sidecar files came or went) and drops deleted ones, so a
run of 10,000 records lists again in milliseconds. Summaries come from documents alone.

A mirror URL is a run too: its files are kept in a local cache (skycap/record/remote.py)
that a background thread brings up to date every `mirror_interval` seconds; rescans read
that cache like any directory, so a slow store never stalls a page.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from skycap.record.reader import RecordError
from skycap.record.remote import MirrorCache
from skycap.viewer import derive
from skycap.viewer.validate import DOCUMENT_SUFFIX, document_problems, listed_files, read_document

UNREADABLE = "unreadable"
#: Characters of a meta value a table row carries.
META_VALUE_CHARS = 200
#: Paths whose trained-token strips a rollouts row draws, one above the other.
STRIPS_SHOWN = 8
MIRROR_INTERVAL = 30.0
logger = logging.getLogger("skycap.viewer")


def group_value(value: Any) -> str | None:
    """A group-key part as a string (JavaScript `String()` spelling), None when ungroupable."""
    if value is None or isinstance(value, dict | list):
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def lookup(meta: Mapping[str, Any], annotations: Mapping[str, Any], key: str) -> Any:
    """docs/viewer.md "Groups": a key is looked up in `meta`, then in `annotations`."""
    return meta[key] if key in meta else annotations.get(key)


def task_of(meta: Mapping[str, Any]) -> str | None:
    """`meta.task_id`, else the base name of `meta.task`, else `meta.instance_id`."""
    for key in ("task_id", "task", "instance_id"):
        value = group_value(meta.get(key))
        if value is not None and key == "task":
            return os.path.basename(value.rstrip("/")) or value
        if value is not None:
            return value
    return None


@dataclass(slots=True)
class Summary:
    """What the listing, filters, groups and health band need of one document."""

    id: str
    stamp: tuple[int, int]
    presence: tuple[bool, ...] = ()
    status: str = UNREADABLE
    created_at: float | None = None
    mode: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    annotations: Mapping[str, Any] = field(default_factory=dict)
    tokens: int | None = None
    trainable: int | None = None
    turns: int = 0
    paths: int = 0
    flags: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    strip: list[list[Any]] = field(default_factory=list)
    strips: list[list[list[Any]]] = field(default_factory=list)
    listed: dict[str, str] = field(default_factory=dict)
    search: str = ""
    # The run index's row for this trajectory (docs/run-index.md "step.json"), when a
    # step.json lists it.
    indexed: Mapping[str, Any] | None = None

    @property
    def reward(self) -> float | None:
        return derive.numeric_reward(self.annotations.get("reward"))

    @property
    def stop_reason(self) -> Any:
        return self.annotations.get("stop_reason")

    @property
    def step(self) -> float | None:
        return derive.as_number(self.meta.get("step"))

    @property
    def task(self) -> str | None:
        return task_of(self.meta)

    @property
    def repetition(self) -> str:
        value = group_value(self.meta.get("repetition_id"))
        return self.id if value is None else value

    @property
    def attempt(self) -> float:
        return derive.as_number(self.meta.get("attempt")) or 0.0

    @property
    def health(self) -> int:
        return derive.health_score(self.flags)

    def group_key(self, keys: tuple[str, ...]) -> str | None:
        parts = [group_value(lookup(self.meta, self.annotations, key)) for key in keys]
        return None if any(p is None for p in parts) else "~".join(parts)

    def row(self) -> dict[str, Any]:
        """The rollouts-table row (flags without the quiet ones, docs/viewer.md "Health band")."""
        return {
            "id": self.id,
            "status": self.status,
            "created_at": self.created_at,
            "mode": self.mode,
            "step": self.step,
            "task": self.task,
            "instance_id": self.meta.get("instance_id"),
            "repetition": self.repetition,
            "attempt": self.attempt,
            "reward": self.reward,
            "stop_reason": self.stop_reason,
            "tokens": self.tokens,
            "trainable": self.trainable,
            "turns": self.turns,
            "paths": self.paths,
            "flags": [f for f in self.flags if f not in derive.QUIET_FLAGS],
            "problems": len(self.problems),
            "strip": self.strip,
            "strips": self.strips,
            # Scalar meta values (any can be a column), long ones cut.
            "meta": {
                key: text[:META_VALUE_CHARS]
                for key, value in self.meta.items()
                if (text := group_value(value)) is not None
            },
            "indexed": self.indexed,
        }


def presence(listed: Mapping[str, str], files: set[str]) -> tuple[bool, ...]:
    return tuple(name in files for name in listed.values())


def text_mode_tokens(derived: derive.Derived) -> int | None:
    """Text mode has no token counts; the largest `usage` total of any call stands in."""
    totals = []
    for call in derive.all_calls(derived):
        usage = derive.as_dict(call.get("usage"))
        total = usage.get("total_tokens")
        if not derive.is_int(total):
            parts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
            total = sum(parts) if all(derive.is_int(p) for p in parts) else None
        if total is not None:
            totals.append(total)
    return max(totals) if totals else None


def summarise(
    doc_id: str,
    stamp: tuple[int, int],
    document: dict[str, Any] | None,
    problems: list[str],
    present: set[str],
) -> Summary:
    """One document's summary; an unreadable one keeps its problem and status `unreadable`."""
    summary = Summary(id=doc_id, stamp=stamp, problems=problems, search=doc_id.lower())
    if document is None:
        return summary
    summary.problems = problems + document_problems(document)
    derived = derive.derive(document)
    status = document.get("status")
    summary.status = status if isinstance(status, str) else str(status)
    summary.created_at = derive.as_number(document.get("created_at"))
    summary.mode = derive.capture_mode(document)
    summary.meta = derive.as_dict(document.get("meta"))
    summary.annotations = derive.as_dict(document.get("annotations"))
    summary.listed = listed_files(document)
    summary.presence = presence(summary.listed, present)
    summary.turns = len(derive.all_calls(derived))
    summary.paths = len(derived.paths)
    if derive.uses_tokens(derived):
        summary.tokens = sum(derive.token_length(node) for node in derived.nodes)
        summary.trainable = sum(c.trainable for c in derived.counts)
    else:
        summary.tokens = text_mode_tokens(derived)
    if derived.paths:
        chars = not derive.uses_tokens(derived)
        summary.strips = [
            derive.strip(derive.path_blocks(derived, i, chars=chars))
            for i in range(min(len(derived.paths), STRIPS_SHOWN))
        ]
        summary.strip = summary.strips[0]
    summary.flags = derive.rollout_flags(document, derived, present)
    text = orjson.dumps([summary.meta, summary.annotations], default=str).decode()
    summary.search = f"{doc_id} {text}".lower()
    return summary


def index_rows(document: Any) -> dict[str, dict[str, Any]]:
    """What the viewer shows of a run index file (docs/run-index.md "step.json"): per
    trajectory id, its phase, step, `trained` and `superseded`. Anything malformed is
    skipped, never fatal."""
    if not isinstance(document, dict) or not isinstance(document.get("rows"), list):
        return {}
    found = {}
    for row in document["rows"]:
        if not isinstance(row, dict) or not isinstance(row.get("id"), str):
            continue
        trained = row.get("trained")
        found[row["id"]] = {
            "phase": document.get("phase"),
            "step": document.get("step"),
            "trained": trained if isinstance(trained, bool) else None,
            "superseded": row.get("superseded") is True,
        }
    return found


class Run:
    """One record directory and its document summaries; `rescan` brings it up to date."""

    def __init__(self, name: str, path: Path, label: str | None = None) -> None:
        self.name = name
        self.path = path
        self.label = label or str(path)  # a mirror run shows its URL, not its cache
        self.summaries: dict[str, Summary] = {}
        self.version = 0
        self.lock = threading.Lock()
        # index/<phase>/step-<N>.json files: their stamps and rows, and the merged rows.
        self._index_files: dict[Path, tuple[tuple[int, int], dict[str, dict[str, Any]]]] = {}
        self.indexed: dict[str, dict[str, Any]] = {}

    def _rescan_index(self) -> bool:
        """Re-read changed index files; True when what they say changed."""
        found: dict[Path, tuple[int, int]] = {}
        for path in (self.path / "index").glob("*/step-*.json"):
            try:
                stat = path.stat()
            except OSError:
                continue
            found[path] = (stat.st_mtime_ns, stat.st_size)
        if found.keys() == self._index_files.keys() and all(
            self._index_files[p][0] == stamp for p, stamp in found.items()
        ):
            return False
        for path, stamp in found.items():
            known = self._index_files.get(path)
            if known is not None and known[0] == stamp:
                continue
            try:
                rows = index_rows(orjson.loads(path.read_bytes()))
            except (OSError, orjson.JSONDecodeError) as exc:
                logger.debug("cannot read %s: %s", path, exc)
                rows = {}
            self._index_files[path] = (stamp, rows)
        for path in set(self._index_files) - set(found):
            del self._index_files[path]
        merged: dict[str, dict[str, Any]] = {}
        for _, rows in sorted(self._index_files.values(), key=lambda item: _step_order(item[1])):
            merged.update(rows)
        changed = merged != self.indexed
        self.indexed = merged
        return changed

    def _listing(self) -> tuple[set[str], dict[str, tuple[int, int]]]:
        files: set[str] = set()
        documents: dict[str, tuple[int, int]] = {}
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return files, documents
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                continue
            files.add(name)
            if name.endswith(DOCUMENT_SUFFIX):
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                if entry.is_file():
                    documents[name[: -len(DOCUMENT_SUFFIX)]] = (stat.st_mtime_ns, stat.st_size)
        return files, documents

    @staticmethod
    def _stale(summary: Summary | None, stamp: tuple[int, int], files: set[str]) -> bool:
        """Changed on disk, or one of its listed sidecar files came or went."""
        return (
            summary is None
            or summary.stamp != stamp
            or summary.presence != presence(summary.listed, files)
        )

    def rescan(self) -> bool:
        """Re-read new and changed documents, drop deleted ones; True when anything changed."""
        with self.lock:
            files, documents = self._listing()
            changed = False
            for doc_id in list(self.summaries):
                if doc_id not in documents:
                    del self.summaries[doc_id]
                    changed = True
            for doc_id, stamp in documents.items():
                if not self._stale(self.summaries.get(doc_id), stamp, files):
                    continue
                document, problems = read_document(self.path / f"{doc_id}{DOCUMENT_SUFFIX}")
                try:
                    summary = summarise(doc_id, stamp, document, problems, files)
                except Exception as exc:  # a document odd enough to break derivation
                    reason = f"cannot summarise: {type(exc).__name__}: {exc}"
                    summary = Summary(id=doc_id, stamp=stamp, problems=[reason])
                self.summaries[doc_id] = summary
                changed = True
            if self._rescan_index():
                changed = True
            if changed:
                for doc_id, summary in self.summaries.items():
                    summary.indexed = self.indexed.get(doc_id)
                self.version += 1
            return changed

    def snapshot(self) -> list[Summary]:
        """The summaries as of the last rescan (taken under the lock a rescan holds)."""
        with self.lock:
            return list(self.summaries.values())

    def info(self) -> dict[str, Any]:
        summaries = self.snapshot()
        modes: dict[str, int] = {}
        for s in summaries:
            modes[s.mode or "unknown"] = modes.get(s.mode or "unknown", 0) + 1
        return {
            "name": self.name,
            "path": self.label,
            "trajectories": len(summaries),
            "unreadable": sum(1 for s in summaries if s.status == UNREADABLE),
            "modes": modes,
            "version": self.version,
        }


def _step_order(rows: dict[str, dict[str, Any]]) -> tuple[float, str]:
    """Index files merge in step order, so a later step's row of an id wins."""
    first = next(iter(rows.values()), {})
    step = first.get("step")
    return (step if isinstance(step, int | float) else -1.0, str(first.get("phase")))


def holds_records(path: Path) -> bool:
    try:
        with os.scandir(path) as entries:
            return any(
                e.name.endswith(DOCUMENT_SUFFIX) and not e.name.startswith(".") for e in entries
            )
    except OSError:
        return False


def subdirectories(path: Path) -> list[Path]:
    try:
        with os.scandir(path) as entries:
            return sorted(
                Path(e.path) for e in entries if e.is_dir() and not e.name.startswith(".")
            )
    except OSError:
        return []


def record_directories(root: Path) -> list[Path]:
    """`root` itself if it holds records, and its children or grandchildren that do.

    A root can hold both: `skycap serve` writes into the folder it is given (./records by
    default) while the demo and the examples each make a run folder inside it.
    """
    found = [root] if holds_records(root) else []
    for child in subdirectories(root):
        if holds_records(child):
            found.append(child)
        else:
            found += [grand for grand in subdirectories(child) if holds_records(grand)]
    return found


def run_name(path: Path) -> str:
    """Named after the directory, or after its parent when the directory is called `skycap`."""
    return path.parent.name if path.name == "skycap" and path.parent.name else path.name


class Index:
    """All runs under the given folders. Safe to call from several server threads."""

    def __init__(
        self,
        roots: list[Path],
        *,
        mirrors: list[MirrorCache] | None = None,
        min_interval: float = 1.0,
        mirror_interval: float = MIRROR_INTERVAL,
    ) -> None:
        self.roots = [Path(root).resolve() for root in roots]
        self.mirrors = list(mirrors or [])
        self.min_interval = min_interval
        self.mirror_interval = mirror_interval
        self.runs: dict[str, Run] = {}
        self._names: dict[Path, str] = {}
        self._lock = threading.Lock()
        self._refreshed_at: float | None = None
        self._mirrors_synced_at: float | None = None
        self._syncing: threading.Thread | None = None

    def _discover(self) -> None:
        for root in self.roots:
            for path in record_directories(root):
                self._add_run(path, run_name(path))
        for mirror in self.mirrors:
            self._add_run(mirror.path, mirror.url.rpartition("/")[2] or mirror.url, mirror.label)

    def _add_run(self, path: Path, base: str, label: str | None = None) -> None:
        if path in self._names:
            return
        name = base
        n = 1
        while name in self.runs:
            n += 1
            name = f"{base}~{n}"
        self._names[path] = name
        self.runs[name] = Run(name, path, label)

    def sync_mirrors(self) -> None:
        """Bring every mirror's cache up to date; a store that fails is logged and retried
        at the next interval (the cache keeps what it had)."""
        for mirror in self.mirrors:
            try:
                mirror.refresh(index=True)
            except (RecordError, OSError) as exc:
                logger.warning("cannot refresh %s: %s", mirror.label, exc)
        self._mirrors_synced_at = time.monotonic()

    def _sync_mirrors_in_background(self) -> None:
        if not self.mirrors or (self._syncing is not None and self._syncing.is_alive()):
            return
        synced = self._mirrors_synced_at
        if synced is not None and time.monotonic() - synced < self.mirror_interval:
            return
        self._syncing = threading.Thread(
            target=self.sync_mirrors, name="skycap-view-mirror", daemon=True
        )
        self._syncing.start()

    def refresh(self, *, force: bool = False) -> None:
        """Find new runs and rescan every run, at most once per `min_interval` unless forced."""
        with self._lock:
            now = time.monotonic()
            if (
                not force
                and self._refreshed_at is not None
                and now - self._refreshed_at < self.min_interval
            ):
                return
            if force and self.mirrors:
                self.sync_mirrors()
            else:
                self._sync_mirrors_in_background()
            self._discover()
            for run in list(self.runs.values()):
                run.rescan()
            self._refreshed_at = time.monotonic()

    def run(self, name: str) -> Run | None:
        self.refresh()
        return self.runs.get(name)

    def listing(self) -> list[dict[str, Any]]:
        self.refresh()
        return [run.info() for run in self.runs.values()]

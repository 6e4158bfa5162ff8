"""The record mirror: copies each written record to an fsspec URL in the background, fail-open.

A capture server writes records to its node-local record directory; a mirror makes
remote storage one more destination of that writer (docs/mirror.md "Where the copies run").
After each local write the record's files are pinned (hard links under `<record dir>/.mirror/`, a
dot-name every reader skips) and queued; worker threads copy them byte for byte to
`{url}/{file name}`, sidecars first and the document last, so a reader that sees a mirrored
document finds its sidecars. Nothing here ever blocks or fails the caller: a slow, down or
refusing store costs counters and a warning, never a trajectory.

Copies of one trajectory are serialised, and a newer submit replaces a queued older one,
so a late reward's rewrite always lands last. Credentials come from the environment or
`storage_options`; neither is logged, and URLs are shown without their userinfo.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skycap.episodes import FailureEpisode
from skycap.record.copier import CopyTimeout, open_copier
from skycap.record.fsspec_store import error_text, open_store, redact, transient
from skycap.record.layout import document_name, sidecar_name
from skycap.record.sidecars import KINDS

logger = logging.getLogger("skycap.mirror")

SNAPSHOT_DIR = ".mirror"
PENDING, COPIED, FAILED, EXCLUDED = "pending", "copied", "failed", "excluded"
# States of this many records are remembered for finish answers (ids only, oldest out).
STATES_KEPT = 100_000


@dataclass(frozen=True)
class MirrorConfig:
    """`record_mirror_config` / `--record-mirror-config`, checked key by key."""

    exclude: tuple[str, ...] = ()
    workers: int = 4
    queue_size: int = 1024
    timeout: float = 300.0
    attempts: int = 3
    backoff: float = 1.0
    shutdown_timeout: float = 60.0
    # Credentials may sit here: never in a repr, a log line or an answer.
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any] | None) -> MirrorConfig:
        """Raises TypeError for an unknown key or a wrong type, ValueError for a bad value."""
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise TypeError(
                f"record_mirror_config must be a mapping (a JSON object), got "
                f"{type(value).__name__}"
            )
        known = cls.__dataclass_fields__
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise TypeError(
                f"record_mirror_config: unknown key {', '.join(map(repr, unknown))}; known keys: "
                f"{', '.join(known)}"
            )
        kwargs: dict[str, Any] = dict(value)
        if "exclude" in kwargs:
            kwargs["exclude"] = _exclude(kwargs["exclude"])
        for key in ("workers", "queue_size", "attempts"):
            if key in kwargs:
                _count(kwargs[key], key)
        for key in ("timeout", "shutdown_timeout"):
            if key in kwargs:
                _seconds(kwargs[key], key, zero=False)
        if "backoff" in kwargs:
            _seconds(kwargs["backoff"], "backoff", zero=True)
        options = kwargs.get("storage_options", {})
        if not isinstance(options, Mapping):
            raise TypeError(
                f"record_mirror_config storage_options must be a mapping, got "
                f"{type(options).__name__}"
            )
        kwargs["storage_options"] = dict(options)
        return cls(**kwargs)


def _exclude(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise TypeError(
            f"record_mirror_config exclude must be a list of sidecar kinds, got {value!r}"
        )
    for kind in value:
        if kind not in KINDS:
            raise ValueError(
                f"record_mirror_config exclude: unknown sidecar kind {kind!r}; known kinds: "
                f"{', '.join(KINDS)}"
            )
    return tuple(dict.fromkeys(value))


def _count(value: Any, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"record_mirror_config {key} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"record_mirror_config {key} must be >= 1, got {value}")


def _seconds(value: Any, key: str, *, zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"record_mirror_config {key} must be a number of seconds, got {value!r}")
    if not (value >= 0 if zero else value > 0) or value != value or value == float("inf"):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"record_mirror_config {key} must be finite and {bound}, got {value}")


def join_url(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"


def mirrored_files(files: list[str], trajectory_id: str, exclude: tuple[str, ...]) -> list[str]:
    """The files of a record the mirror holds: `files` without the excluded sidecar kinds."""
    left_out = {sidecar_name(trajectory_id, kind) for kind in exclude}
    return [name for name in files if name not in left_out]


@dataclass
class _Job:
    """One record to copy: its pinned files, in copy order."""

    trajectory_id: str
    pinned: list[tuple[str, Path]]  # (file name, its pinned link), sidecars first
    excluded: bool


class _Abandoned(Exception):
    """A copy that overran `timeout` (or found too many hanging ones): never retried."""


class RecordMirror:
    """Copies records to one fsspec URL on worker threads; every method is thread-safe."""

    def __init__(self, url: str, config: MirrorConfig | None = None) -> None:
        self.url = url.rstrip("/")
        self.config = config or MirrorConfig()
        self._fs, self._root = open_store(self.url, self.config.storage_options)
        self._lock = threading.Condition()
        self._ready: deque[str] = deque()  # ids whose job may start (none of theirs running)
        self._jobs: dict[str, _Job] = {}  # queued jobs, one per trajectory
        self._running: set[str] = set()
        self._states: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._threads: list[threading.Thread] = []
        self._copier = open_copier(
            self.url, self.config.storage_options, self._fs, self._root, self.config.workers
        )
        self._closed = False
        self._stop = threading.Event()
        self._sequence = itertools.count()
        self._folders: set[Path] = set()
        self._held: set[str] = set()  # queued, waiting for release()
        # A mirror that is down fails every record: one episode, not a line each.
        self.copies = FailureEpisode(
            logger, f"record mirror {redact(self.url)}: records are not copied (local ones are)"
        )
        self.counters = {
            "mirrored": 0,
            "failed": 0,
            "timed_out": 0,
            "dropped": 0,
            "retried": 0,
            "bytes": 0,
        }

    # -- the server's side ---------------------------------------------------------------------

    def submit(
        self, record_dir: Path, trajectory_id: str, files: list[str], *, hold: bool = False
    ) -> None:
        """Queue the record just written to `record_dir`; never raises, never waits.

        Called right after the write, before the next write of the same trajectory (the
        server holds the trajectory's lock), so the pinned files are exactly that write's.
        With `hold`, the copy waits for `release(trajectory_id)`: a finish releases it once
        its answer is sent, so the copy's CPU does not compete with that answer.
        """
        try:
            self._submit(Path(record_dir), trajectory_id, files, hold)
        except Exception as exc:  # fail-open: the local record is written, that is what counts
            self._drop(trajectory_id, f"could not queue the copy: {error_text(exc)}")

    def _submit(self, record_dir: Path, trajectory_id: str, files: list[str], hold: bool) -> None:
        names = mirrored_files(files, trajectory_id, self.config.exclude)
        with self._lock:
            if self._closed:
                self._drop(trajectory_id, "the mirror is closed (server shutting down)")
                return
            replacing = trajectory_id in self._jobs
            if not replacing and len(self._jobs) >= self.config.queue_size:
                self._drop(
                    trajectory_id,
                    f"the copy queue is full ({self.config.queue_size} records queued)",
                )
                return
        job = _Job(trajectory_id, self._pin(record_dir, names), excluded=len(names) < len(files))
        with self._lock:
            if self._closed:  # closed while the files were pinned
                self._drop(trajectory_id, "the mirror is closed (server shutting down)")
                _unpin(job)
                return
            old = self._jobs.get(trajectory_id)
            self._jobs[trajectory_id] = job
            self._set_state(trajectory_id, PENDING, None)
            if hold:
                self._held.add(trajectory_id)
            elif old is None and trajectory_id not in self._running:
                self._ready.append(trajectory_id)
            self._start_workers()
            self._lock.notify()
        if old is not None:  # the newer write replaces the queued older one
            _unpin(old)

    def _pin(self, record_dir: Path, names: list[str]) -> list[tuple[str, Path]]:
        """Hard-link the files just written, so a later rewrite cannot mix into this copy.

        One link per file into one flat folder: the cost a finish pays for the mirror.
        """
        folder = record_dir / SNAPSHOT_DIR
        if folder not in self._folders:
            folder.mkdir(exist_ok=True)
            self._folders.add(folder)
        sequence = next(self._sequence)
        pinned = []
        for name in names:
            link = folder / f"{os.getpid()}.{sequence}.{name}"
            try:
                os.link(record_dir / name, link)
            except OSError:  # a file system without hard links: copy instead
                shutil.copyfile(record_dir / name, link)
            pinned.append((name, link))
        return pinned

    def release(self, trajectory_id: str) -> None:
        """Let a held copy start (no-op when nothing of this trajectory is held)."""
        with self._lock:
            if trajectory_id not in self._held:
                return
            self._held.discard(trajectory_id)
            self._make_ready(trajectory_id)

    def _make_ready(self, trajectory_id: str) -> None:
        if (
            trajectory_id in self._jobs
            and trajectory_id not in self._running
            and trajectory_id not in self._ready
        ):
            self._ready.append(trajectory_id)
            self._lock.notify()

    def location(self, trajectory_id: str, files: list[str]) -> dict[str, Any]:
        """The mirror part of a finish answer's `record` object (http.md §2.3)."""
        with self._lock:
            state, error = self._states.get(trajectory_id, (None, None))
        return {
            "mirror": join_url(redact(self.url), document_name(trajectory_id)),
            "files": mirrored_files(files, trajectory_id, self.config.exclude),
            "mirror_state": state,
            "mirror_error": error,
        }

    def health(self) -> dict[str, Any]:
        """The `/healthz` `record_mirror` counters (docs/mirror.md "Counters", plus `bytes`)."""
        with self._lock:
            pending = len(self._jobs) + len(self._running)
            return {"url": redact(self.url), **self.counters, "pending": pending}

    def close(self, timeout: float | None = None) -> list[str]:
        """Stop accepting, let the workers drain the queue for at most `timeout` seconds
        (default `shutdown_timeout`), drop what is left; return the ids not copied.

        Copies still running past the deadline are left on daemon threads (they may land).
        """
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        with self._lock:
            self._closed = True
            for trajectory_id in list(self._held):
                self._make_ready(trajectory_id)
            self._held.clear()
            self._lock.wait_for(lambda: not self._jobs and not self._running, timeout)
            left = list(self._jobs.values())
            self._jobs.clear()
            self._ready.clear()
            running = sorted(self._running)
            for job in left:
                self._drop(job.trajectory_id, "left in the queue at shutdown")
            self._stop.set()
            self._lock.notify_all()
        for job in left:
            _unpin(job)
        self._copier.close(wait=not running)
        lost = sorted(job.trajectory_id for job in left) + running
        if lost:
            shown = ", ".join(lost[:20]) + (f" and {len(lost) - 20} more" if len(lost) > 20 else "")
            logger.warning(
                "record mirror %s: %d record(s) not copied at shutdown after %.1f s (their local "
                "records are complete): %s",
                redact(self.url),
                len(lost),
                timeout,
                shown,
            )
        return lost

    def wait_idle(self, timeout: float) -> bool:
        """Whether nothing is queued or running within `timeout` seconds (tests, benchmarks)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._jobs and not self._running, timeout)

    # -- bookkeeping (callers hold self._lock; it is re-entrant) -------------------------------

    def _set_state(self, trajectory_id: str, state: str, error: str | None) -> None:
        self._states[trajectory_id] = (state, error)
        self._states.move_to_end(trajectory_id)
        if len(self._states) > STATES_KEPT:
            self._states.popitem(last=False)

    def _drop(self, trajectory_id: str, why: str) -> None:
        with self._lock:
            self.counters["dropped"] += 1
            self._set_state(trajectory_id, FAILED, f"not copied: {why}")
        self.copies.failed(trajectory_id, why)

    def _start_workers(self) -> None:
        """Workers start lazily, on the first submit."""
        while len(self._threads) < self.config.workers:
            thread = threading.Thread(
                target=self._work, name=f"skycap-mirror-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    # -- the workers ---------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._ready or self._stop.is_set())
                if not self._ready:
                    return
                trajectory_id = self._ready.popleft()
                job = self._jobs.pop(trajectory_id)
                self._running.add(trajectory_id)
            try:
                state, error = self._copy(job)
            except Exception as exc:  # a bug here must not kill the worker
                state, error = FAILED, error_text(exc)
            finally:
                _unpin(job)
            with self._lock:
                self._running.discard(trajectory_id)
                if trajectory_id in self._jobs:  # a newer write came in while this one copied
                    if trajectory_id not in self._held:
                        self._ready.append(trajectory_id)
                elif self._states.get(trajectory_id, (PENDING,))[0] == PENDING:
                    self._set_state(trajectory_id, state, error)
                if state == FAILED:
                    self.counters["failed"] += 1
                else:
                    self.counters["mirrored"] += 1
                self._lock.notify_all()
            if state == FAILED:
                self.copies.failed(trajectory_id, f"copying failed: {error}")
            else:
                self.copies.succeeded()

    def _copy(self, job: _Job) -> tuple[str, str | None]:
        """Copy the job's files in order, stopping at the first failure."""
        for name, pinned in job.pinned:
            try:
                self._copy_file(pinned, f"{self._root}/{name}")
            except _Abandoned as exc:
                with self._lock:
                    self.counters["timed_out"] += 1
                return FAILED, f"{name}: {exc}"
            except Exception as exc:
                return FAILED, f"{name}: {error_text(exc)}"
        return (EXCLUDED if job.excluded else COPIED), None

    def _copy_file(self, local: Path, remote: str) -> None:
        """One file, with bounded retries of transient errors and a timeout per try."""
        size = local.stat().st_size
        attempts = self.config.attempts
        for attempt in range(1, attempts + 1):
            try:
                self._put_within_timeout(local, remote)
            except _Abandoned:
                raise
            except Exception as exc:
                if not transient(exc):
                    raise
                if attempt == attempts or self._stop.is_set():
                    raise
                with self._lock:
                    self.counters["retried"] += 1
                self._stop.wait(self.config.backoff * 2 ** (attempt - 1))
                continue
            with self._lock:
                self.counters["bytes"] += size
            return

    def _put_within_timeout(self, local: Path, remote: str) -> None:
        """One put by the copier, abandoned (not retried) past `timeout`."""
        hanging = self._copier.hanging()
        if hanging >= 2 * self.config.workers:
            raise _Abandoned(
                f"{hanging} earlier copies still hang past the {self.config.timeout:g} s "
                "timeout; not trying"
            )
        try:
            self._copier.put(local, remote, self.config.timeout)
        except CopyTimeout as exc:
            raise _Abandoned(str(exc)) from None


def _unpin(job: _Job) -> None:
    for _, link in job.pinned:
        with contextlib.suppress(OSError):
            link.unlink()

"""The trajectory store: live trajectories, finish (http.md §2.3), TTL sweep, shutdown writes.

Everything here runs on the server's event loop; record writes and reads go to worker
threads (`asyncio.to_thread`) so a large record never stalls other trajectories' calls.
A per-trajectory lock serialises finish, the TTL sweep and shutdown writes (D-13).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from skycap.record.journal import Journal, replay_journals
from skycap.record.layout import KINDS, document_name, sidecar_name
from skycap.record.mirror import RecordMirror
from skycap.record.reader import (
    RecordError,
    document_path,
    read_document,
    record_document,
    trajectory_from_document,
)
from skycap.record.writer import write_record
from skycap.samples import (
    ALL,
    BUILTIN_RULES,
    PathRuleFailed,
    build_samples,
    encode_sample,
    rows_for_finish,
    rows_from_samples_field,
    samples_field,
)
from skycap.server.keys import new_api_key
from skycap.server.options import ServerOptions
from skycap.server.retry import RetryCache
from skycap.trajectory import (
    ABANDONED,
    FINISHED,
    OPEN,
    AnnotationConflict,
    Trajectory,
    is_trajectory_id,
    new_trajectory_id,
)
from skycap.wire import control_error

logger = logging.getLogger("skycap.server")
#: Set by the `skycap serve --workers N` supervisor, which replays the crash journals once
#: before its workers start (D-44): the workers then do not race to replay them.
JOURNALS_REPLAYED_VARIABLE = "SKYCAP_JOURNALS_REPLAYED"

UNKNOWN = "unknown trajectory"
# Why a trajectory in memory takes no more calls though its status is unchanged (D-44).
SHUTTING_DOWN = "the capture server is shutting down; this call was not made"
REPLAYED = (
    "trajectory was rebuilt from the crash journal after the server stopped; it takes no "
    "more calls, finish it with POST /trajectories/{id}/finish"
)
# How often records that could not be written are tried again (D-44).
RETRY_INTERVAL = 5.0
# How many ended trajectories' context_length_exceeded flags a server remembers (ids only).
CONTEXT_EXCEEDED_KEPT = 100_000
#: Trajectories ended in this process that `GET /trajectories?ended=recent` lists (D-49).
RECENT_ENDED = 256
Release = Callable[[str], Awaitable[None]]
DecodeSpans = Callable[..., Any]


class Live:
    """A trajectory in memory with what only the server needs: key, lock, calls in flight."""

    __slots__ = (
        "trajectory",
        "api_key",
        "lock",
        "retries",
        "inflight",
        "last_activity",
        "last_call",
        "calls",
        "unwritten",
        "counted_failures",
        "closed",
        "__weakref__",
    )

    def __init__(self, trajectory: Trajectory, api_key: str, lock: asyncio.Lock) -> None:
        self.trajectory = trajectory
        self.api_key = api_key.encode("ascii")
        self.lock = lock
        self.retries = RetryCache()
        # call token -> how to cancel it (drop its connection or cancel its task), http.md §6
        self.inflight: dict[object, Callable[[], None]] = {}
        self.last_activity = time.time()
        self.last_call: dict[str, Any] | None = None
        self.calls = sum(len(node.calls) for node in trajectory.graph)
        self.unwritten = False
        # Failures already in `failures_total`: one read back from disk counts none again.
        self.counted_failures = len(trajectory.failures)
        # Why it takes no more calls while its status stays as it is (D-44), else None.
        self.closed: str | None = None

    @property
    def id(self) -> str:
        return self.trajectory.id

    def touch(self) -> None:
        self.last_activity = time.time()

    def cancel_inflight(self, keep: object = None) -> None:
        """Cancel every call in flight except `keep` (sealing, http.md §6)."""
        for token, cancel in list(self.inflight.items()):
            if token is not keep:
                self.inflight.pop(token, None)
                cancel()


@dataclass(frozen=True, slots=True)
class Answer:
    """A control-route answer: status and JSON body bytes, and what to run once it is sent."""

    status: int
    body: bytes
    sent: Callable[[], None] | None = None

    @classmethod
    def json(cls, status: int, value: Any) -> Answer:
        return cls(status, orjson.dumps(value))

    @classmethod
    def error(cls, status: int, message: str, code: str | None = None) -> Answer:
        return cls(status, control_error(message, code))


class TrajectoryStore:
    """Creates, finds, finishes and writes trajectories; counts calls for /healthz (D-7)."""

    def __init__(
        self,
        options: ServerOptions,
        capture: dict[str, Any],
        *,
        release: Release | None = None,
        decode_spans: DecodeSpans | None = None,
    ) -> None:
        self.options = options
        self.capture = capture
        self.record_dir: Path | None = options.record_dir  # type: ignore[assignment]
        self._release = release
        self._decode_spans = decode_spans
        self._live: dict[str, Live] = {}
        # Trajectories that left memory after a context_length_exceeded refusal: the record
        # format has no field for it, so a repeat finish in this process still reports it.
        self._context_exceeded: dict[str, None] = {}
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._sweeper: asyncio.Task[None] | None = None
        self._retrier: asyncio.Task[None] | None = None
        self._record_host: str | None = None
        self.journal: Journal | None = None
        if self.record_dir is not None:
            try:
                self.journal = Journal(self.record_dir, fsync=options.journal_fsync)
            except OSError as exc:  # serve anyway: records are still written at the end
                logger.error(
                    "the crash journal cannot be kept in %s: %s; a killed server would lose "
                    "its open trajectories",
                    self.record_dir,
                    exc,
                )
        self.closing = False
        # Trajectories whose record could not be written by the end of shutdown (D-44).
        self.lost: list[str] = []
        self.mirror: RecordMirror | None = None
        if options.record_mirror is not None:
            self.mirror = RecordMirror(options.record_mirror, options.mirror_config)
        self.calls_total = 0
        self.tokens_total = 0
        self._failures_total = 0
        self.ended_total = 0
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_ENDED)

    # -- lookup and creation -----------------------------------------------------------------

    def create(self, meta: dict[str, Any]) -> Live:
        trajectory_id = new_trajectory_id()
        trajectory = Trajectory(trajectory_id, capture=self.capture, meta=meta)
        live = Live(trajectory, new_api_key(), self._lock_for(trajectory_id))
        self._live[trajectory_id] = live
        if self.closing:
            live.closed = SHUTTING_DOWN
        if self.journal is not None:
            try:
                self.journal.open(trajectory)
            except (OSError, ValueError) as exc:  # its first call tries again
                logger.error(
                    "the crash journal of %s cannot be started in %s: %s",
                    trajectory_id,
                    self.journal.directory,
                    exc,
                )
        return live

    def get(self, trajectory_id: str) -> Live | None:
        return self._live.get(trajectory_id)

    def on_disk(self, trajectory_id: str) -> bool:
        """Whether an ended record exists; ids outside the id alphabet never touch the disk."""
        if self.record_dir is None or not is_trajectory_id(trajectory_id):
            return False
        return document_path(self.record_dir, trajectory_id).is_file()

    async def written_unended(self, trajectory_id: str) -> bool:
        """Whether the record on disk was written before the trajectory ended (at a shutdown,
        http.md §6), so a harness can be told to finish it rather than that it has ended.

        An unreadable record counts as ended: its finish will report what is wrong with it.
        """
        if not self.on_disk(trajectory_id):
            return False
        assert self.record_dir is not None
        path = document_path(self.record_dir, trajectory_id)
        try:
            document = await asyncio.to_thread(read_document, path)
        except (RecordError, OSError):
            return False
        return document.get("ended") is False

    def _lock_for(self, trajectory_id: str) -> asyncio.Lock:
        lock = self._locks.get(trajectory_id)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[trajectory_id] = lock
        return lock

    # -- calls -------------------------------------------------------------------------------

    def note_commit(self, live: Live, call: dict[str, Any]) -> None:
        """Count a committed call for /healthz and remember it for `GET /trajectories`."""
        live.calls += 1
        self.calls_total += 1
        usage = call.get("usage")
        if isinstance(usage, dict):
            for key in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens"):
                value = usage.get(key)
                if type(value) is int:
                    self.tokens_total += value
        live.last_call = {
            "latency_ms": round((call["t_end"] - call["t_start"]) * 1000.0, 3),
            "finish_reason": call.get("finish_reason"),
        }
        if self.journal is not None:
            # Before the answer leaves (D-44): a killed server still has this call.
            failing = self.journal.broken(live.id)
            try:
                self.journal.append(live.trajectory, live.calls)
            except (OSError, TypeError, ValueError) as exc:
                # Once per outage: a full disk would otherwise log every call.
                (logger.debug if failing else logger.error)(
                    "the crash journal of %s in %s cannot be written: %s; the call is "
                    "answered, and the journal is rewritten whole once it can be",
                    live.id,
                    self.journal.directory,
                    exc,
                )
            else:
                if failing:
                    logger.warning("the crash journal of %s is written again", live.id)

    def note_failure(self, live: Live, status: int | None, error: str) -> None:
        """Append a failure while the trajectory is open (a sealed one records none)."""
        live.trajectory.add_failure(status, error)

    @property
    def failures_total(self) -> int:
        """Failures recorded in this process, however they were added (text, token mode).

        Counted from the trajectories themselves, so no call path can skip the counter.
        """
        for live in self._live.values():
            self._count_failures(live)
        return self._failures_total

    def _count_failures(self, live: Live) -> None:
        added = len(live.trajectory.failures) - live.counted_failures
        if added > 0:
            self._failures_total += added
            live.counted_failures += added

    # -- finish (http.md §2.3, D-13) -------------------------------------------------------------

    def known_rule(self, name: str) -> bool:
        return name in BUILTIN_RULES or name in self.options.rules

    def rule_names(self) -> list[str]:
        return [*BUILTIN_RULES, *self.options.rules]

    async def finish(
        self, trajectory_id: str, annotations: dict[str, Any], paths: str | None
    ) -> Answer:
        """Steps 1-6 of http.md §2.3; `paths` is None when the request gave none (D-13)."""
        if not is_trajectory_id(trajectory_id):
            return Answer.error(404, UNKNOWN)
        async with self._lock_for(trajectory_id):
            live = self._live.get(trajectory_id)
            if live is not None:
                trajectory = live.trajectory
            else:
                loaded = await self._load(trajectory_id)
                if isinstance(loaded, Answer):
                    return loaded
                trajectory = loaded
                trajectory.context_length_exceeded = trajectory_id in self._context_exceeded
            return await self._finish_locked(trajectory, live, annotations, paths)

    async def _finish_locked(
        self,
        trajectory: Trajectory,
        live: Live | None,
        annotations: dict[str, Any],
        paths: str | None,
    ) -> Answer:
        recorded = trajectory.samples
        if recorded is not None:
            try:
                rows_from_samples_field(trajectory.graph, recorded)
            except (ValueError, AttributeError) as exc:  # a damaged record (issue 17)
                return _unreadable(trajectory.id, exc, "record_error")
        if recorded is not None and paths is not None and paths != recorded.get("paths"):
            return Answer.error(
                409, f"trajectory already finished with paths='{recorded.get('paths')}'"
            )
        before = dict(trajectory.annotations)
        if trajectory.is_open:
            self._seal(trajectory, live, FINISHED)
        try:
            trajectory.merge_annotations(annotations)
        except AnnotationConflict as exc:
            return Answer.error(409, str(exc))
        rows, failure, sampled_now = self._rows(trajectory, paths)
        ended_now = not trajectory.ended
        if ended_now:
            trajectory.ended = True
            await self._release_engine(trajectory.id)
        changed = ended_now or sampled_now or trajectory.annotations != before
        # The record's mirror copy starts once the answer is sent, so its CPU does not
        # compete with the answer's delivery; on any other way out, at once.
        mirror = self.mirror
        sent = None if mirror is None else functools.partial(mirror.release, trajectory.id)
        try:
            record = await self._settle(trajectory, live, changed, keep=failure is not None)
            if ended_now:
                self._note_ended(trajectory, live, record)
            if failure is not None:
                return Answer.error(500, str(failure), "path_rule_failed")
            body = await asyncio.to_thread(_finish_body, trajectory, rows, record)
            answer, sent = Answer(200, body, sent=sent), None
            return answer
        finally:
            if sent is not None:
                sent()

    def _rows(
        self, trajectory: Trajectory, paths: str | None
    ) -> tuple[list, Exception | None, bool]:
        """(rows, rule failure, whether rows were recorded now) for step 3."""
        recorded = trajectory.samples
        if recorded is not None:
            return rows_from_samples_field(trajectory.graph, recorded), None, False
        name = paths or ALL
        try:
            rows = rows_for_finish(trajectory.graph, name, self.options.rules)
        except PathRuleFailed as exc:
            logger.warning("finish %s: %s", trajectory.id, exc)
            return [], exc, False
        trajectory.samples = samples_field(name, rows)
        return rows, None, True

    async def _settle(
        self, trajectory: Trajectory, live: Live | None, changed: bool, *, keep: bool
    ) -> dict[str, Any] | None:
        """Step 5: write what changed, then drop it from memory; return the `record` object."""
        if self.record_dir is None:
            if live is not None and not self.options.keep_unrecorded and not keep:
                self._forget(trajectory)
            return None
        if not changed and not (live is not None and live.unwritten):
            return self._location(trajectory.id) if live is None else None
        files = await self._write(trajectory, hold=True)
        if files is None:
            if live is None:
                live = self._adopt(trajectory)
            live.unwritten = True
            return None
        self._forget(trajectory)
        return self._location(trajectory.id, files)

    def _forget(self, trajectory: Trajectory) -> None:
        """Drop a written (or unrecordable) trajectory from memory, keeping its one
        memory-only fact, `context_length_exceeded`, for a later finish."""
        live = self._live.pop(trajectory.id, None)
        if live is not None:
            self._count_failures(live)
        if trajectory.context_length_exceeded:
            self._context_exceeded[trajectory.id] = None
            if len(self._context_exceeded) > CONTEXT_EXCEEDED_KEPT:
                del self._context_exceeded[next(iter(self._context_exceeded))]

    def _adopt(self, trajectory: Trajectory) -> Live:
        """Keep a trajectory read from disk in memory after its rewrite failed (§2.3 step 5)."""
        live = Live(trajectory, new_api_key(), self._lock_for(trajectory.id))
        self._live[trajectory.id] = live
        return live

    def _seal(self, trajectory: Trajectory, live: Live | None, status: str) -> None:
        trajectory.seal(status)
        if live is not None:
            live.cancel_inflight()

    async def _release_engine(self, trajectory_id: str) -> None:
        if self._release is None:
            return
        try:
            await self._release(trajectory_id)
        except Exception as exc:  # best effort (http.md §11): a release never fails a finish
            logger.warning("releasing engine state of %s failed: %s", trajectory_id, exc)

    # -- records -------------------------------------------------------------------------------

    async def _write(
        self, trajectory: Trajectory, *, hold: bool = False, retry: bool = False
    ) -> list[str] | None:
        """Write off the event loop, then drop its journal; None (logged) when it failed.
        With `hold`, the mirror's copy waits for `mirror.release` (a finish's answer).

        A failed write is an error (D-44): the trajectory stays in memory, `/healthz`
        answers 503 and the write is retried; a retry's failure is logged at debug only.
        """
        assert self.record_dir is not None
        try:
            files = await asyncio.to_thread(self._write_files, trajectory, hold)
        except Exception as exc:  # a failed write keeps the trajectory in memory for a retry
            (logger.debug if retry else logger.error)(
                "the record of %s cannot be written to %s: %s: %s; kept in memory and "
                "retried every %g s",
                trajectory.id,
                document_path(self.record_dir, trajectory.id),
                type(exc).__name__,
                exc,
                RETRY_INTERVAL,
            )
            return None
        if retry:
            logger.warning("the record of %s was written on a retry", trajectory.id)
        if self.journal is not None:
            self.journal.remove(trajectory.id)
        return files

    def _write_files(self, trajectory: Trajectory, hold: bool) -> list[str]:
        """The local atomic write, then (fail-open) the mirror's copy of exactly those files."""
        assert self.record_dir is not None
        files = write_record(trajectory, self.record_dir, decode_spans=self._decode_spans)
        if self.mirror is not None:
            self.mirror.submit(self.record_dir, trajectory.id, files, hold=hold)
        return files

    async def _load(self, trajectory_id: str) -> Trajectory | Answer:
        if not self.on_disk(trajectory_id):
            return Answer.error(404, UNKNOWN)
        assert self.record_dir is not None
        try:
            return await asyncio.to_thread(_load_complete, self.record_dir, trajectory_id)
        except (RecordError, OSError) as exc:
            logger.warning("reading the record of %s failed: %s", trajectory_id, exc)
            return _unreadable(trajectory_id, exc)

    def _location(self, trajectory_id: str, files: list[str] | None = None) -> dict[str, Any]:
        assert self.record_dir is not None
        if files is None:
            names = [sidecar_name(trajectory_id, kind) for kind in KINDS]
            files = [n for n in names if (self.record_dir / n).is_file()]
            files.append(document_name(trajectory_id))
        location = {
            "host": self.record_host(),
            "path": str(self.record_dir / document_name(trajectory_id)),
            "mirror": None,
            "files": files,
            "mirror_state": None,
            "mirror_error": None,
        }
        if self.mirror is not None:
            location.update(self.mirror.location(trajectory_id, files))
        return location

    def record_host(self) -> str:
        """`--record-host`, else a non-loopback advertise host, else the primary address."""
        if self._record_host is None:
            configured = self.options.record_host
            advertised = self.options.advertise_host
            if configured:
                self._record_host = configured
            elif advertised not in ("127.0.0.1", "::1", "localhost"):
                self._record_host = advertised
            else:
                self._record_host = primary_address()
        return self._record_host

    # -- reads ---------------------------------------------------------------------------------

    async def document(self, trajectory_id: str) -> Answer:
        """`GET /trajectories/{id}`: the live document, else the stored one as written."""
        live = self._live.get(trajectory_id)
        if live is not None:
            return Answer.json(200, live.trajectory.document(live=True))
        if not self.on_disk(trajectory_id):
            return Answer.error(404, UNKNOWN)
        assert self.record_dir is not None
        path = document_path(self.record_dir, trajectory_id)
        try:
            return Answer(200, await asyncio.to_thread(_stored_document, path))
        except (RecordError, OSError) as exc:
            return _unreadable(trajectory_id, exc)

    def record_location(self, trajectory_id: str) -> Answer:
        """`GET /trajectories/{id}/record`: where the record is and its mirror copy's state
        now (the finish answer's `record` object, which is taken at finish time)."""
        if not self.on_disk(trajectory_id):
            live = self._live.get(trajectory_id)
            if live is not None:
                return Answer.error(404, f"trajectory {trajectory_id} has no record yet")
            return Answer.error(404, UNKNOWN)
        return Answer.json(200, self._location(trajectory_id))

    def listing(self) -> list[dict[str, Any]]:
        """The live trajectories, newest first, with the fields of D-7 and D-49."""
        now = time.time()
        lives = sorted(self._live.values(), key=lambda x: x.trajectory.created_at, reverse=True)
        return [_row(live, now) for live in lives]

    def recent(self) -> list[dict[str, Any]]:
        """`GET /trajectories?ended=recent`: the last trajectories ended here, newest first."""
        return list(reversed(self._recent))

    def _note_ended(
        self, trajectory: Trajectory, live: Live | None, record: dict[str, Any] | None
    ) -> None:
        """Remember a trajectory that ended now (finish or TTL) for `recent()` (D-49)."""
        if live is None:  # read back from disk: it ended in an earlier process
            return
        self.ended_total += 1
        now = time.time()
        row = _row(live, now)
        row["ended_at"] = now
        row["annotations"] = dict(trajectory.annotations)
        # Where the record is: None while it is in memory (no record dir, or a failed write
        # that is retried at the next finish or at shutdown).
        row["record"] = record
        self._recent.append(row)

    def unwritten(self) -> list[str]:
        """Ids of trajectories whose record could not be written yet (D-44)."""
        return [live.id for live in self._live.values() if live.unwritten]

    def health(self) -> dict[str, Any]:
        unwritten = self.unwritten()
        health = {
            "ok": not unwritten,
            "unwritten_records": unwritten,
            "open_trajectories": sum(1 for x in self._live.values() if x.trajectory.status == OPEN),
            "capture": self.capture,
            "calls_total": self.calls_total,
            "tokens_total": self.tokens_total,
            "failures_total": self.failures_total,
            "ended_total": self.ended_total,
        }
        if self.mirror is not None:
            health["record_mirror"] = self.mirror.health()
        return health

    # -- TTL and shutdown (http.md §6) -----------------------------------------------------------

    def start(self) -> None:
        """Start the idle sweep and the write retries (only with a record directory:
        nothing expires or is written without one)."""
        if self.record_dir is not None and self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.create_task(self._sweep_forever())
            self._retrier = loop.create_task(self._retry_forever())

    def recover(self) -> None:
        """Replay the crash journals of servers that stopped without writing (D-44).

        Each comes back as a record written `ended: false`, which can be finished and takes
        no calls; one that cannot be written stays in memory, closed, and is retried. It
        runs on the loop, blocking it, at start: a call or finish that arrives meanwhile
        waits and then finds the record, rather than a 404.
        """
        if self.record_dir is None or os.environ.get(JOURNALS_REPLAYED_VARIABLE) == "1":
            return  # a `serve --workers` supervisor replayed them once, before its workers
        # Through _write_files, so a replayed record reaches the mirror like any other.
        replayed = replay_journals(self.record_dir, lambda t: self._write_files(t, False))
        for trajectory in replayed.unwritten:
            live = self._adopt(trajectory)
            live.unwritten = True
            live.closed = REPLAYED.format(id=trajectory.id)

    async def _retry_forever(self) -> None:
        while True:
            await asyncio.sleep(min(RETRY_INTERVAL, self.options.sweep_interval))
            try:
                await self.retry_unwritten()
            except Exception:  # the retries must outlive one bad trajectory
                logger.exception("retrying unwritten records failed")

    async def retry_unwritten(self) -> None:
        """Try again to write each record that could not be written (D-44)."""
        for live in list(self._live.values()):
            if not live.unwritten:
                continue
            async with live.lock:
                if not live.unwritten or self._live.get(live.id) is not live:
                    continue
                if await self._write(live.trajectory, retry=True) is not None:
                    live.unwritten = False
                    if live.trajectory.ended or live.closed is not None:
                        self._forget(live.trajectory)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.sweep_interval)
            try:
                await self.sweep()
            except Exception:  # the sweep must outlive one bad trajectory
                logger.exception("the TTL sweep failed")

    async def sweep(self) -> None:
        """End, as abandoned, each idle trajectory that is not ended and has no call in flight."""
        cutoff = time.time() - self.options.ttl
        for live in list(self._live.values()):
            if self._expired(live, cutoff):
                async with live.lock:
                    if self._expired(live, cutoff) and self._live.get(live.id) is live:
                        await self._abandon(live)

    @staticmethod
    def _expired(live: Live, cutoff: float) -> bool:
        return not live.trajectory.ended and not live.inflight and live.last_activity < cutoff

    async def _abandon(self, live: Live) -> None:
        trajectory = live.trajectory
        trajectory.seal(ABANDONED)
        trajectory.ended = True
        await self._release_engine(trajectory.id)
        files = await self._write(trajectory)
        if files is None:
            live.unwritten = True
        else:
            self._forget(trajectory)
        self._note_ended(
            trajectory, live, None if files is None else self._location(trajectory.id, files)
        )
        logger.info("trajectory %s ended by the idle TTL as %s", trajectory.id, trajectory.status)

    def close_to_calls(self) -> None:
        """The first step of a shutdown (D-44): every trajectory takes no more calls (they
        get 503) with its status unchanged, and calls in flight are cancelled, so nothing
        is answered that its record would not hold."""
        self.closing = True
        for live in self._live.values():
            if live.closed is None:
                live.closed = SHUTTING_DOWN
            for _ in live.inflight:  # a call cut off by the shutdown is a failure, not silence
                self.note_failure(live, None, SHUTDOWN_FAILURE)
            live.cancel_inflight()

    async def shutdown(self) -> None:
        """Stop the sweep, close every trajectory to calls, then write each as it stands.

        Records still unwritten afterwards are listed in `lost` (their crash journals stay
        behind for the next start to replay).
        """
        for task in (self._sweeper, self._retrier):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sweeper = self._retrier = None
        self.close_to_calls()
        await asyncio.gather(*(self._shutdown_one(live) for live in list(self._live.values())))
        if self.mirror is not None:  # waits at most shutdown_timeout, then reports the rest
            await asyncio.to_thread(self.mirror.close)
        if self.record_dir is not None:
            self.lost = self.unwritten()
            if self.lost:
                logger.error(
                    "%d records could not be written to %s and are lost from this process "
                    "(their crash journals stay in %s for the next start): %s",
                    len(self.lost),
                    self.record_dir,
                    self.journal.directory if self.journal is not None else "-",
                    ", ".join(self.lost),
                )
        if self.journal is not None:
            self.journal.close()

    async def _shutdown_one(self, live: Live) -> None:
        async with live.lock:
            if not live.trajectory.ended:
                await self._release_engine(live.id)
            if self.record_dir is None:
                return
            if await self._write(live.trajectory) is not None:
                live.unwritten = False
                self._forget(live.trajectory)
            else:
                live.unwritten = True


SHUTDOWN_FAILURE = "the server shut down before the call's reply arrived"
#: D-39: a trajectory that ends with nothing captured says so.
NO_CALLS_WARNING = "no model call was captured"


def _row(live: Live, now: float) -> dict[str, Any]:
    """One `GET /trajectories` row (D-7, D-49)."""
    trajectory = live.trajectory
    graph = trajectory.graph
    failures = trajectory.failures
    last = failures[-1] if failures else None
    return {
        "id": trajectory.id,
        "status": trajectory.status,
        "meta": trajectory.meta,
        "created_at": trajectory.created_at,
        "age_s": round(now - trajectory.created_at, 3),
        "calls": live.calls,
        "nodes": len(graph),
        "paths": sum(1 for node in graph if not node.children),
        "unbridged_calls": trajectory.unbridged_calls(),
        "failures": len(failures),
        "last_failure": None if last is None else {"at": last["t"], "message": last["error"]},
        "last_activity": live.last_activity,
        # A call in flight waits on the model, not on the harness: not idle (nor swept).
        "idle_s": 0.0 if live.inflight else round(max(0.0, now - live.last_activity), 3),
        "last_call": live.last_call,
    }


def _finish_body(trajectory: Trajectory, rows: list, record: dict[str, Any] | None) -> bytes:
    """The 200 finish body; samples are built here, in a worker thread (arrays can be large)."""
    samples = [encode_sample(sample) for sample in build_samples(trajectory.graph, rows)]
    calls = sum(len(node.calls) for node in trajectory.graph)
    body: dict[str, Any] = {
        "id": trajectory.id,
        "status": trajectory.status,
        "samples": samples,
        "calls": calls,
        "unbridged_calls": trajectory.unbridged_calls(),
        "record": record,
        "context_length_exceeded": trajectory.context_length_exceeded,
    }
    if calls == 0:
        body["warnings"] = [NO_CALLS_WARNING]  # D-39
    return orjson.dumps(body)


def _load_complete(record_dir: Path, trajectory_id: str) -> Trajectory:
    """Load a record to end or rewrite it, refusing one whose listed sidecars are gone:
    rewriting it would drop the tokens, experts or masks it still lists."""
    document = record_document(record_dir, trajectory_id)
    missing = [
        kind
        for kind, entry in document["sidecars"].items()
        if not (record_dir / str(entry.get("file"))).is_file()
    ]
    if missing:
        raise RecordError(
            f"its manifest lists {', '.join(missing)} but the file is not in {record_dir}; "
            "restore it before finishing this trajectory"
        )
    return trajectory_from_document(record_dir, document)


def _stored_document(path: Path) -> bytes:
    return orjson.dumps(read_document(path))


def _unreadable(trajectory_id: str, exc: Exception, code: str | None = None) -> Answer:
    """The 500 for a record on disk that cannot be read (or is damaged)."""
    return Answer.error(500, f"the record of {trajectory_id} cannot be read: {exc}", code)


def primary_address() -> str:
    """The local address a UDP socket toward a public resolver would use (nothing is sent)."""
    for family, target in ((socket.AF_INET, "8.8.8.8"), (socket.AF_INET6, "2001:4860:4860::8888")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 53))
                return probe.getsockname()[0]
        except OSError:
            continue
    return socket.gethostname()

"""The trajectory store: live trajectories, finish (http.md §2.3), TTL sweep, shutdown writes.

Everything here runs on the server's event loop; record writes and reads go to worker
threads through `records.Records`, so a large record never stalls other trajectories' calls.
A per-trajectory lock serialises finish, the TTL sweep and shutdown writes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from skycap.episodes import FailureEpisode
from skycap.record.reader import RecordError
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
from skycap.server.answer import Answer
from skycap.server.keys import new_api_key
from skycap.server.live import Live
from skycap.server.options import ServerOptions
from skycap.server.records import RETRY_INTERVAL, DecodeSpans, Records
from skycap.trajectory import (
    ABANDONED,
    FINISHED,
    OPEN,
    AnnotationConflict,
    Trajectory,
    is_trajectory_id,
    new_trajectory_id,
)

logger = logging.getLogger("skycap.server")

UNKNOWN = "unknown trajectory"
# Why a trajectory in memory takes no more calls though its status is unchanged.
SHUTTING_DOWN = "the capture server is shutting down; this call was not made"
REPLAYED = (
    "trajectory was rebuilt from the crash journal after the server stopped; it takes no "
    "more calls, finish it with POST /trajectories/{id}/finish"
)
# How many ended trajectories' context_length_exceeded flags a server remembers (ids only).
CONTEXT_EXCEEDED_KEPT = 100_000
#: Trajectories ended in this process that `GET /trajectories?ended=recent` lists.
RECENT_ENDED = 256
Release = Callable[[str], Awaitable[None]]


class TrajectoryStore:
    """Creates, finds, finishes and writes trajectories; counts calls for /healthz."""

    def __init__(
        self,
        options: ServerOptions,
        capture: dict[str, Any],
        *,
        release: Release | None = None,
        decode_spans: DecodeSpans | None = None,
        provenance: Callable[[], dict[str, Any]] | None = None,
        counters: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.options = options
        self.capture = capture
        self._provenance = provenance
        self.records = Records(options, decode_spans)
        #: Each cause that can fail many trajectories at once, by its `/healthz` name
        #: (docs/http.md §13); a call mode adds its upstream's in `attach`.
        self.episodes: dict[str, FailureEpisode] = {
            "record_write": self.records.writes,
            "journal_write": self.records.journals,
        }
        if self.records.mirror is not None:
            self.episodes["mirror_copy"] = self.records.mirror.copies
        self._release = release
        self._mode_counters = counters
        self._live: dict[str, Live] = {}
        # Trajectories that left memory after a context_length_exceeded refusal: the record
        # format has no field for it, so a repeat finish in this process still reports it.
        self._context_exceeded: dict[str, None] = {}
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._sweeper: asyncio.Task[None] | None = None
        self._retrier: asyncio.Task[None] | None = None
        #: Set once the crash journals are replayed: requests other than `/healthz` wait for it.
        self.replayed = asyncio.Event()
        self.closing = False
        # Trajectories whose record could not be written by the end of shutdown.
        self.lost: list[str] = []
        # Trajectories still open when shutdown began (written with status open).
        self.open_at_shutdown: list[str] = []
        self.calls_total = 0
        self.tokens_total = 0
        self._failures_total = 0
        self.ended_total = 0
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_ENDED)

    # -- lookup and creation -----------------------------------------------------------------

    def create(self, meta: dict[str, Any]) -> Live:
        trajectory_id = new_trajectory_id()
        provenance = None if self._provenance is None else self._provenance()
        trajectory = Trajectory(
            trajectory_id, capture=self.capture, meta=meta, provenance=provenance
        )
        live = Live(trajectory, new_api_key(), self._lock_for(trajectory_id))
        self._live[trajectory_id] = live
        if self.closing:
            live.closed = SHUTTING_DOWN
        self.records.open_journal(trajectory)
        return live

    def get(self, trajectory_id: str) -> Live | None:
        return self._live.get(trajectory_id)

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
        # Before the answer leaves: a killed server still has this call.
        self.records.journal_call(live.trajectory, live.calls)

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

    # -- finish (http.md §2.3) -------------------------------------------------------------

    def known_rule(self, name: str) -> bool:
        return name in BUILTIN_RULES or name in self.options.rules

    def rule_names(self) -> list[str]:
        return [*BUILTIN_RULES, *self.options.rules]

    async def finish(
        self, trajectory_id: str, annotations: dict[str, Any], paths: str | None
    ) -> Answer:
        """The steps of http.md §2.3 and its answer; `paths` is None when the request gave none."""
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
        mirror = self.records.mirror
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
        if self.records.directory is None:
            if live is not None and not self.options.keep_unrecorded and not keep:
                self._forget(trajectory)
            return None
        if not changed and not (live is not None and live.unwritten):
            return self.records.location(trajectory.id) if live is None else None
        files = await self.records.write(trajectory, hold=True)
        if files is None:
            if live is None:
                live = self._adopt(trajectory)
            live.unwritten = True
            return None
        self._forget(trajectory)
        return self.records.location(trajectory.id, files)

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
        """Keep a trajectory read from disk in memory after its rewrite failed (http.md §2.3)."""
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
        except Exception as exc:
            # Best effort (docs/tokens.md "Engines and renderers"): a release never fails a finish.
            logger.warning("releasing engine state of %s failed: %s", trajectory_id, exc)

    async def _load(self, trajectory_id: str) -> Trajectory | Answer:
        if not self.records.on_disk(trajectory_id):
            return Answer.error(404, UNKNOWN)
        try:
            return await self.records.load(trajectory_id)
        except (RecordError, OSError) as exc:
            return _unreadable(trajectory_id, exc)

    # -- reads ---------------------------------------------------------------------------------

    async def document(self, trajectory_id: str) -> Answer:
        """`GET /trajectories/{id}`: the live document, else the stored one as written."""
        live = self._live.get(trajectory_id)
        if live is not None:
            return Answer.json(200, live.trajectory.document(live=True))
        if not self.records.on_disk(trajectory_id):
            return Answer.error(404, UNKNOWN)
        try:
            return Answer(200, await self.records.document_bytes(trajectory_id))
        except (RecordError, OSError) as exc:
            return _unreadable(trajectory_id, exc)

    def record_location(self, trajectory_id: str) -> Answer:
        """`GET /trajectories/{id}/record`: where the record is and its mirror copy's state
        now (the finish answer's `record` object, which is taken at finish time)."""
        if not self.records.on_disk(trajectory_id):
            live = self._live.get(trajectory_id)
            if live is not None:
                return Answer.error(404, f"trajectory {trajectory_id} has no record yet")
            return Answer.error(404, UNKNOWN)
        return Answer.json(200, self.records.location(trajectory_id))

    def listing(self) -> list[dict[str, Any]]:
        """The live trajectories, newest first, with the fields of http.md §2.2."""
        now = time.time()
        lives = sorted(self._live.values(), key=lambda x: x.trajectory.created_at, reverse=True)
        return [live.row(now) for live in lives]

    def recent(self) -> list[dict[str, Any]]:
        """`GET /trajectories?ended=recent`: the last trajectories ended here, newest first."""
        return list(reversed(self._recent))

    def _note_ended(
        self, trajectory: Trajectory, live: Live | None, record: dict[str, Any] | None
    ) -> None:
        """Remember a trajectory that ended now (finish or TTL) for `recent()`."""
        if live is None:  # read back from disk: it ended in an earlier process
            return
        self.ended_total += 1
        now = time.time()
        row = live.row(now)
        row["ended_at"] = now
        row["annotations"] = dict(trajectory.annotations)
        # Where the record is: None while it is in memory (no record dir, or a failed write
        # that is retried at the next finish or at shutdown).
        row["record"] = record
        self._recent.append(row)

    def unwritten(self) -> list[str]:
        """Ids of trajectories whose record could not be written yet."""
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
        if self._mode_counters is not None:
            health.update(self._mode_counters())
        if self.records.mirror is not None:
            health["record_mirror"] = self.records.mirror.health()
        health["failing_causes"] = {
            name: episode.health() for name, episode in self.episodes.items()
        }
        return health

    # -- TTL and shutdown (http.md §6) -----------------------------------------------------------

    def start(self) -> None:
        """Start the idle sweep and the write retries (only with a record directory:
        nothing expires or is written without one)."""
        if self.records.directory is not None and self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.create_task(self._sweep_forever())
            self._retrier = loop.create_task(self._retry_forever())

    async def recover(self) -> None:
        """Replay the crash journals of servers that stopped without writing.

        Each comes back as a record written `ended: false`, which can be finished and takes
        no calls; one that cannot be written stays in memory, closed, and is retried. The
        replay runs on a thread, so `/healthz` answers meanwhile; every other request
        waits for it (`replayed`) and then finds the record, rather than a 404.
        """
        try:
            for trajectory in await asyncio.to_thread(self.records.replay):
                live = self._adopt(trajectory)
                live.unwritten = True
                live.closed = REPLAYED.format(id=trajectory.id)
        finally:
            self.replayed.set()

    async def _retry_forever(self) -> None:
        while True:
            await asyncio.sleep(min(RETRY_INTERVAL, self.options.sweep_interval))
            try:
                await self.retry_unwritten()
            except Exception:  # the retries must outlive one bad trajectory
                logger.exception("retrying unwritten records failed")

    async def retry_unwritten(self) -> None:
        """Try again to write each record that could not be written."""
        for live in list(self._live.values()):
            if not live.unwritten:
                continue
            async with live.lock:
                if not live.unwritten or self._live.get(live.id) is not live:
                    continue
                if await self.records.write(live.trajectory, retry=True) is not None:
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
        files = await self.records.write(trajectory)
        if files is None:
            live.unwritten = True
        else:
            self._forget(trajectory)
        location = None if files is None else self.records.location(trajectory.id, files)
        self._note_ended(trajectory, live, location)
        logger.info("trajectory %s ended by the idle TTL as %s", trajectory.id, trajectory.status)

    def close_to_calls(self) -> None:
        """The first step of a shutdown: every trajectory takes no more calls (they
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
        self.open_at_shutdown = [
            live.id for live in self._live.values() if not live.trajectory.ended
        ]
        await asyncio.gather(*(self._shutdown_one(live) for live in list(self._live.values())))
        if self.records.mirror is not None:  # waits at most shutdown_timeout, then reports the rest
            await asyncio.to_thread(self.records.mirror.close)
        if self.records.directory is not None:
            self.lost = self.unwritten()
            if self.lost:
                journal = self.records.journal
                logger.error(
                    "%d records could not be written to %s and are lost from this process "
                    "(their crash journals stay in %s for the next start): %s",
                    len(self.lost),
                    self.records.directory,
                    journal.directory if journal is not None else "-",
                    ", ".join(self.lost),
                )
        self.records.close()

    async def _shutdown_one(self, live: Live) -> None:
        async with live.lock:
            if not live.trajectory.ended:
                await self._release_engine(live.id)
            if self.records.directory is None:
                return
            if await self.records.write(live.trajectory) is not None:
                live.unwritten = False
                self._forget(live.trajectory)
            else:
                live.unwritten = True


SHUTDOWN_FAILURE = "the server shut down before the call's reply arrived"
#: A trajectory that ends with nothing captured says so.
NO_CALLS_WARNING = "no model call was captured"


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
        body["warnings"] = [NO_CALLS_WARNING]  # an empty trajectory says so
    return orjson.dumps(body)


def _unreadable(trajectory_id: str, exc: Exception, code: str | None = None) -> Answer:
    """The 500 for a record on disk that cannot be read (or is damaged)."""
    return Answer.error(500, f"the record of {trajectory_id} cannot be read: {exc}", code)

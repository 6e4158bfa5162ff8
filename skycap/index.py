"""`skycap.index`: each training step's records indexed in W&B and beside the records.

    index = RecordIndex(wandb.run, record_dir="./records", mirror="s3://bucket/run-7")
    ...  # runner.generate(...) as often as the step needs, then train
    index.log_step(step, "train", trained_ids, runner.record_log)
    index.close()

`log_step` builds the step's `step.json` (docs/run-index.md "step.json": one row per attempt
the rollout loop opened, `trained` as the trainer says) on the caller's thread, so a bug in
it raises there, and writes it to `<record dir>/index/<phase>/step-<N>.json`. Everything that talks
to remote services runs on background workers that fail open: one for W&B (one artifact
version of `skycap-records-<phase>-<run id>` per step, aliased `<phase>-step-<N>` and
`latest`, holding `step.json` and one reference entry per file of each mirrored record,
so no record bytes are uploaded) and one that writes the same `step.json` to the mirror's
`index/`. Client side only: it never imports mitmproxy; wandb is the `wandb` extra.
See docs/run-index.md.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from skycap.record.mirror import join_url, open_store, redact
from skycap.rollout.log import RecordLog

__all__ = ["RecordIndex", "IndexConfig", "artifact_name"]

logger = logging.getLogger("skycap.index")

FORMAT_VERSION = 1
ARTIFACT_TYPE = "skycap-records"
MISSING_EXTRA = (
    "skycap.index needs wandb to log to W&B: install skycap[wandb] "
    "(in a checkout: uv sync --extra wandb)"
)
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# OSErrors a retry cannot fix; every other OSError (connection resets, timeouts) is transient.
_PERMANENT = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)
_ERROR_CHARS = 300


def artifact_name(phase: str, run_id: str) -> str:
    """The W&B artifact that holds a phase's step indexes: `skycap-records-<phase>-<run id>`."""
    return f"skycap-records-{phase}-{run_id}"


def step_path(phase: str, step: int) -> str:
    """Where a step's index lives inside a record directory or a mirror
    (docs/run-index.md "step.json")."""
    return f"index/{phase}/step-{step}.json"


@dataclass(frozen=True)
class IndexConfig:
    """How the background workers treat a slow or failing W&B or mirror.

    `timeout` bounds one W&B version (or one mirror write) in seconds: past it the call is
    abandoned, never retried (it may still land). `attempts` counts tries for transient
    errors before W&B accepted the version, `backoff` the first wait between them
    (doubling). `queue_size` steps wait per worker; past it a new step is dropped.
    `close_timeout` is how long `close()` waits for the queues by default.
    """

    timeout: float = 120.0
    attempts: int = 3
    backoff: float = 1.0
    queue_size: int = 16
    close_timeout: float = 60.0

    def __post_init__(self) -> None:
        for key in ("timeout", "close_timeout"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"IndexConfig {key} must be seconds > 0, got {value!r}")
        if isinstance(self.backoff, bool) or not isinstance(self.backoff, int | float):
            raise ValueError(f"IndexConfig backoff must be seconds >= 0, got {self.backoff!r}")
        if not self.backoff >= 0:
            raise ValueError(f"IndexConfig backoff must be seconds >= 0, got {self.backoff!r}")
        for key in ("attempts", "queue_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"IndexConfig {key} must be an integer >= 1, got {value!r}")


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, _Accepted):
        return str(exc)
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:_ERROR_CHARS]}"


class _Accepted(Exception):
    """The service accepted the work, then it failed: counted, never retried."""


@dataclass
class _Job:
    label: str
    run: Callable[[], None]


class _Worker:
    """One background thread running jobs in order, each bounded by a timeout; fails open.

    A job runs on a short-lived daemon thread the worker waits for, so a call that hangs is
    abandoned at the timeout while the worker moves on. Transient errors are retried with
    backoff within the same timeout; `_Accepted` and any other error end the job.
    """

    def __init__(
        self, name: str, config: IndexConfig, transient: Callable[[BaseException], bool]
    ) -> None:
        self.name = name
        self.config = config
        self._transient = transient
        self._queue: deque[_Job] = deque()
        self._lock = threading.Condition()
        self._running: _Job | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.counters = {
            "logged": 0,
            "failed": 0,
            "timed_out": 0,
            "dropped": 0,
            "retried": 0,
        }

    def submit(self, job: _Job) -> bool:
        """Queue a job; False (counted, warned) when the queue is full or closed."""
        with self._lock:
            if self._closed or len(self._queue) >= self.config.queue_size:
                why = "closed" if self._closed else f"full ({self.config.queue_size} queued)"
                self.counters["dropped"] += 1
                logger.warning("%s: %s not logged: the queue is %s", self.name, job.label, why)
                return False
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"skycap-index-{self.name}", daemon=True
                )
                self._thread.start()
            self._lock.notify_all()
            return True

    def stats(self) -> dict[str, int]:
        with self._lock:
            pending = len(self._queue) + (self._running is not None)
            return {**self.counters, "pending": pending}

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                job = self._running = self._queue.popleft()
            outcome = self._run(job)
            with self._lock:
                self.counters[outcome] += 1
                self._running = None
                self._lock.notify_all()

    def _run(self, job: _Job) -> str:
        deadline = time.monotonic() + self.config.timeout
        delay = self.config.backoff
        for attempt in range(self.config.attempts):
            done, failure = self._start(job)
            if not done.wait(max(0.0, deadline - time.monotonic())):
                logger.warning(
                    "%s: %s timed out after %g s (abandoned, not retried)",
                    self.name,
                    job.label,
                    self.config.timeout,
                )
                return "timed_out"
            if not failure:
                return "logged"
            exc = failure[0]
            retry = (
                not isinstance(exc, _Accepted)
                and self._transient(exc)
                and attempt + 1 < self.config.attempts
                and time.monotonic() + delay < deadline
            )
            if not retry:
                logger.warning("%s: %s failed: %s", self.name, job.label, _error_text(exc))
                return "failed"
            with self._lock:
                self.counters["retried"] += 1
            logger.info("%s: %s: %s; retrying", self.name, job.label, _error_text(exc))
            time.sleep(delay)  # backoff between tries of a transient error
            delay *= 2
        return "failed"

    def _start(self, job: _Job) -> tuple[threading.Event, list[BaseException]]:
        """Run `job` on its own daemon thread; the event is set when it ends, with what it
        raised in the list."""
        done = threading.Event()
        failure: list[BaseException] = []

        def call() -> None:
            try:
                job.run()
            except BaseException as exc:  # reported to the worker, never raised here
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=call, name=f"skycap-index-{self.name}-call", daemon=True).start()
        return done, failure

    def close(self, deadline: float) -> list[str]:
        """Wait until `deadline` (monotonic) for the queue; drop and return what is left."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            self._lock.wait_for(
                lambda: not self._queue and self._running is None,
                max(0.0, deadline - time.monotonic()),
            )
            left = [job.label for job in self._queue]
            self._queue.clear()
            self.counters["dropped"] += len(left)
            if self._running is not None:
                left.append(self._running.label)
            self._lock.notify_all()
        return left


def _wandb_transient(exc: BaseException) -> bool:
    """W&B errors worth another try: its communication errors and transport failures."""
    try:
        from wandb.errors import AuthenticationError, CommError
    except ImportError:  # pragma: no cover - the worker only exists with wandb installed
        CommError = AuthenticationError = ()  # type: ignore[assignment,misc]  # noqa: N806
    if isinstance(exc, AuthenticationError):
        return False
    if isinstance(exc, CommError):
        return True
    return _os_transient(exc)


def _os_transient(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if type(exc).__name__ in ("ConnectionError", "HTTPClientError", "ClientConnectionError"):
        return True
    return isinstance(exc, OSError) and not isinstance(exc, _PERMANENT)


def _wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ImportError(MISSING_EXTRA) from None
    return wandb


class RecordIndex:
    """Indexes each step's records in a W&B run, the record directory and the mirror.

    `run` is a live wandb run (`wandb.init(...)`'s result), or a run name (a string) for
    an index kept only in files. `phases` are the phases indexed (add `"eval"` to index
    evaluation in its own artifact); `record_dir` gets `index/<phase>/step-<N>.json`;
    `mirror` (a URL such as `s3://bucket/run-7`, the capture servers' record mirror)
    gets the same file, written with `storage_options`.
    """

    def __init__(
        self,
        run: Any,
        phases: Iterable[str] = ("train",),
        record_dir: str | os.PathLike[str] | None = None,
        mirror: str | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        config: IndexConfig | None = None,
    ) -> None:
        if isinstance(phases, str):
            raise TypeError(f"phases must be a list of phase names, got the string {phases!r}")
        self.phases = tuple(dict.fromkeys(phases))
        for phase in self.phases:
            _check_name(phase, "phase")
        self.config = config or IndexConfig()
        self._owns_run = False
        if isinstance(run, str):
            if not run:
                raise ValueError("run must be a wandb run or a non-empty run name")
            self.run, self.run_name, self.run_id = None, run, None
        else:
            _wandb()
            if not callable(getattr(run, "log_artifact", None)):
                raise TypeError(
                    f"run must be a wandb run (wandb.init(...)) or a run name, got "
                    f"{type(run).__name__}"
                )
            self.run = run
            self.run_id = str(run.id)
            self.run_name = str(run.name or run.id)
            _check_name(self.run_id, "the wandb run id")
        self.record_dir = None if record_dir is None else Path(record_dir)
        if self.record_dir is not None:
            (self.record_dir / "index").mkdir(parents=True, exist_ok=True)
        self.mirror = None if mirror is None else mirror.rstrip("/")
        self._store: Any = None
        if self.mirror is not None:
            self._store = open_store(self.mirror, storage_options)
        self._wandb_worker = _Worker("W&B", self.config, _wandb_transient)
        self._mirror_worker = _Worker(
            f"mirror {redact(self.mirror)}" if self.mirror else "mirror", self.config, _os_transient
        )
        self._indexed: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.counters = {"steps": 0, "rows": 0, "discarded": 0, "skipped": 0}
        self._local = {"written": 0, "failed": 0}

    @classmethod
    def init(
        cls,
        project: str | None = None,
        name: str | None = None,
        *,
        phases: Iterable[str] = ("train",),
        record_dir: str | os.PathLike[str] | None = None,
        mirror: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        config: IndexConfig | None = None,
        **init_kwargs: Any,
    ) -> RecordIndex:
        """Start a wandb run (`wandb.init(project=..., name=..., **init_kwargs)`) and index
        into it; `close()` finishes that run."""
        run = _wandb().init(project=project, name=name, **init_kwargs)
        index = cls(
            run,
            phases,
            record_dir,
            mirror,
            storage_options=storage_options,
            config=config,
        )
        index._owns_run = True
        return index

    # -- the caller's side -------------------------------------------------------------------

    def log_step(
        self,
        step: int,
        phase: str,
        trained_ids: Iterable[str] | None,
        log: RecordLog,
    ) -> dict[str, Any] | None:
        """Index one step: every attempt `log` holds for `phase` and `step`, however many
        `generate` calls the step took. Returns the step document (None for a phase not
        in `phases`, whose attempts are only discarded).

        `trained_ids` are the trajectory ids the trainer trained on (None: it does not say,
        and `trained` is null). The step's attempts leave `log`, and so do the attempts of
        batches dropped unfinished (a `generate` that raised or was cancelled), unindexed.
        Runs on the caller's thread up to the local write; W&B and the mirror get it later.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if not isinstance(phase, str) or not phase:
            raise ValueError(f"phase must be a non-empty string such as 'train', got {phase!r}")
        if not isinstance(log, RecordLog):
            raise TypeError(
                f"log must be a RecordLog (such as runner.record_log), got {type(log).__name__}"
            )
        trained = _trained_set(trained_ids)
        with self._lock:
            if self._closed:
                raise RuntimeError("this RecordIndex is closed")
            dropped = log.discard(phase, dropped=True)
            self.counters["discarded"] += len(dropped)
            if dropped:
                logger.info(
                    "%s: %d attempt(s) of dropped batches discarded, not indexed",
                    phase,
                    len(dropped),
                )
            if phase not in self.phases:
                gone = log.discard(phase, step)
                self.counters["skipped"] += len(gone)
                return None
            if (phase, step) in self._indexed:
                raise ValueError(
                    f"{phase} step {step} is already indexed; log each step once, after its "
                    "last generate call"
                )
            rows = log.rows(phase, step, trained)
            document = {
                "format_version": FORMAT_VERSION,
                "run": self.run_name,
                "phase": phase,
                "step": step,
                "rows": rows,
            }
            data = orjson.dumps(document)  # TypeError for what JSON cannot hold
            references = _references(rows) if self.run is not None else []
            log.discard(phase, step)
            self._indexed.add((phase, step))
            self.counters["steps"] += 1
            self.counters["rows"] += len(rows)
        self._write_local(phase, step, data)
        label = f"{phase} step {step}"
        if self._store is not None:
            self._mirror_worker.submit(_Job(label, lambda: self._write_mirror(phase, step, data)))
        if self.run is not None:
            aliases = [f"{phase}-step-{step}", "latest"]
            metadata = _metadata(document, references)
            self._wandb_worker.submit(
                _Job(label, lambda: self._log_version(phase, data, references, aliases, metadata))
            )
        return document

    def _write_local(self, phase: str, step: int, data: bytes) -> None:
        """The record directory's copy: atomic (temp file, then rename); fails open."""
        if self.record_dir is None:
            return
        path = self.record_dir / step_path(phase, step)
        temp = path.with_name(f".{path.name}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temp.write_bytes(data)
            os.replace(temp, path)
        except OSError as exc:
            self._local["failed"] += 1
            logger.warning("cannot write %s: %s", path, _error_text(exc))
            return
        self._local["written"] += 1

    # -- the workers' side -------------------------------------------------------------------

    def _write_mirror(self, phase: str, step: int, data: bytes) -> None:
        fs, root = self._store
        path = f"{root}/{step_path(phase, step)}"
        fs.makedirs(path.rpartition("/")[0], exist_ok=True)  # a no-op on object stores
        fs.pipe_file(path, data)

    def _log_version(
        self,
        phase: str,
        data: bytes,
        references: list[tuple[str, str]],
        aliases: list[str],
        metadata: dict[str, Any],
    ) -> None:
        """Build the artifact and log it; once W&B took it, a failure is never retried."""
        wandb = _wandb()
        assert self.run_id is not None
        artifact = wandb.Artifact(
            artifact_name(phase, self.run_id), type=ARTIFACT_TYPE, metadata=metadata
        )
        with artifact.new_file("step.json", mode="wb") as f:
            f.write(data)
        for uri, name in references:
            artifact.add_reference(uri, name=name, checksum=False)
        logged = self.run.log_artifact(artifact, aliases=aliases)
        if getattr(self.run, "offline", False):
            return
        try:
            logged.wait()  # W&B accepted the version: from here on, no retry
        except Exception as exc:
            raise _Accepted(f"W&B took the version, then: {_error_text(exc)}") from exc

    # -- shutting down -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters: steps and rows indexed, attempts discarded (dropped batches) and
        skipped (phases not indexed), local writes, and per worker `logged`, `failed`,
        `timed_out`, `dropped`, `retried` and `pending`."""
        with self._lock:
            out: dict[str, Any] = {**self.counters, "local": dict(self._local)}
        out["wandb"] = self._wandb_worker.stats()
        out["mirror"] = self._mirror_worker.stats()
        return out

    def close(self, timeout: float | None = None) -> list[str]:
        """Wait at most `timeout` seconds (default `config.close_timeout`) for W&B and the
        mirror to take what is queued; drop the rest. Returns what was not logged.

        An index created by `init` then finishes its run, within the same deadline.
        """
        timeout = self.config.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
        left = [f"W&B {label}" for label in self._wandb_worker.close(deadline)]
        left += [f"mirror {label}" for label in self._mirror_worker.close(deadline)]
        if left:
            logger.warning(
                "index: %d step(s) not logged by close (%.1f s): %s",
                len(left),
                timeout,
                ", ".join(left),
            )
        if self._owns_run and self.run is not None:
            finished = threading.Thread(target=self.run.finish, daemon=True)
            finished.start()
            finished.join(max(0.0, deadline - time.monotonic()))
            if finished.is_alive():
                logger.warning("index: the wandb run did not finish within %.1f s", timeout)
        return left

    def __enter__(self) -> RecordIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_name(value: str, what: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{what} must be letters, digits, '-', '_' or '.' (it names files and W&B "
            f"artifacts), got {value!r}"
        )


def _trained_set(trained_ids: Iterable[str] | None) -> set[str] | None:
    if trained_ids is None:
        return None
    if isinstance(trained_ids, str):
        raise TypeError("trained_ids must be a collection of trajectory ids, not one string")
    trained = set(trained_ids)
    wrong = [t for t in trained if not isinstance(t, str)]
    if wrong:
        raise TypeError(f"trained_ids must be trajectory id strings, got {wrong[0]!r:.80}")
    return trained


def _references(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(URI, `records/<file>`) for each file of each record in the mirror.

    A record whose copy failed is not in the mirror: it stays in step.json only, like a
    record without a mirror.
    """
    out = []
    for row in rows:
        record = row.get("record") or {}
        mirror = record.get("mirror")
        if not isinstance(mirror, str) or record.get("mirror_state") == "failed":
            continue
        folder, _, document = mirror.rpartition("/")
        for name in record.get("files") or [document]:
            out.append((join_url(folder, name), f"records/{name}"))
    return out


def _metadata(document: dict[str, Any], references: list[tuple[str, str]]) -> dict[str, Any]:
    rows = document["rows"]
    return {
        "run": document["run"],
        "phase": document["phase"],
        "step": document["step"],
        "rows": len(rows),
        "trained": sum(1 for r in rows if r["trained"]),
        "superseded": sum(1 for r in rows if r["superseded"]),
        "mirrored_files": len(references),
    }

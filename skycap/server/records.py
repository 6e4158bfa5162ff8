"""The store's disk side: records written and read off the event loop, the journal, the mirror.

`Records` is what `TrajectoryStore` asks of the record directory: whether a record is
there, writing one atomically in a worker thread (then handing exactly those files to the
record mirror, and dropping the crash journal), reading one back to end or show it, the
journal line of each committed call, and where a record is (`record` objects).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from skycap.episodes import FailureEpisode
from skycap.record.journal import Journal, journal_dir, replay_journals
from skycap.record.layout import document_name, sidecar_name
from skycap.record.mirror import RecordMirror
from skycap.record.reader import (
    RecordError,
    document_path,
    read_document,
    record_document,
    trajectory_from_document,
)
from skycap.record.sidecars import KINDS
from skycap.record.writer import write_record
from skycap.server.options import ServerOptions
from skycap.trajectory import Trajectory, is_trajectory_id

logger = logging.getLogger("skycap.server")
#: Set by the `skycap serve --workers N` supervisor, which replays the crash journals once
#: before its workers start: the workers then do not race to replay them.
JOURNALS_REPLAYED_VARIABLE = "SKYCAP_JOURNALS_REPLAYED"
# How often records that could not be written are tried again.
RETRY_INTERVAL = 5.0
DecodeSpans = Callable[..., Any]


class Records:
    """One server's record directory (None: records stay in memory), journal and mirror."""

    def __init__(self, options: ServerOptions, decode_spans: DecodeSpans | None = None) -> None:
        self.options = options
        self.directory: Path | None = options.record_dir  # type: ignore[assignment]
        self._decode_spans = decode_spans
        self._host: str | None = None
        self.journal: Journal | None = None
        if self.directory is not None:
            try:
                self.journal = Journal(self.directory, fsync=options.journal_fsync)
            except OSError as exc:  # serve anyway: records are still written at the end
                logger.error(
                    "the crash journal cannot be kept in %s: %s; a killed server would lose "
                    "its open trajectories",
                    self.directory,
                    exc,
                )
        # A full disk fails every trajectory: one episode per cause, not a line each.
        self.writes = FailureEpisode(
            logger,
            f"records cannot be written to {self.directory} (kept in memory, /healthz "
            f"answers 503, retried every {RETRY_INTERVAL:g} s)",
        )
        self.journals = FailureEpisode(
            logger,
            f"crash journals cannot be written in "
            f"{journal_dir(self.directory) if self.directory is not None else None} "
            "(calls are answered; a journal is rewritten whole once it can be)",
        )
        self.mirror: RecordMirror | None = None
        if options.record_mirror is not None:
            self.mirror = RecordMirror(options.record_mirror, options.mirror_config)

    # -- the crash journal ------------------------------------------------------------

    def open_journal(self, trajectory: Trajectory) -> None:
        """Start a new trajectory's journal; a failure is reported and its first call retries."""
        if self.journal is None:
            return
        try:
            self.journal.open(trajectory)
        except (OSError, ValueError) as exc:
            logger.debug("the crash journal of %s cannot be started: %s", trajectory.id, exc)
            self.journals.failed(trajectory.id, f"starting one: {exc}")

    def journal_call(self, trajectory: Trajectory, calls: int) -> None:
        """Journal a committed call before its answer leaves, so a killed server has it."""
        if self.journal is None:
            return
        try:
            self.journal.append(trajectory, calls)
        except (OSError, TypeError, ValueError) as exc:
            logger.debug("the crash journal of %s cannot be written: %s", trajectory.id, exc)
            self.journals.failed(trajectory.id, str(exc))
        else:
            self.journals.succeeded(trajectory.id)

    def replay(self) -> list[Trajectory]:
        """Replay the crash journals of servers that stopped without writing, each
        written as a record `ended: false`; return those whose record could not be written.

        Nothing is replayed without a record directory, or when a `serve --workers`
        supervisor replayed them once, before its workers.
        """
        if self.directory is None or os.environ.get(JOURNALS_REPLAYED_VARIABLE) == "1":
            return []
        # Through write_files, so a replayed record reaches the mirror like any other.
        return replay_journals(self.directory, lambda t: self.write_files(t, False)).unwritten

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    # -- writing -----------------------------------------------------------------------------

    async def write(
        self, trajectory: Trajectory, *, hold: bool = False, retry: bool = False
    ) -> list[str] | None:
        """Write off the event loop, then drop its journal; None (logged) when it failed.
        With `hold`, the mirror's copy waits for `mirror.release` (a finish's answer).

        A failed write is an error: the trajectory stays in memory, `/healthz`
        answers 503 and the write is retried (`retry`); the failures of one cause are
        one episode (skycap.episodes), each trajectory's at debug only.
        """
        assert self.directory is not None
        try:
            files = await asyncio.to_thread(self.write_files, trajectory, hold)
        except Exception as exc:  # a failed write keeps the trajectory in memory for a retry
            path = document_path(self.directory, trajectory.id)
            logger.debug("the record of %s cannot be written to %s: %r", trajectory.id, path, exc)
            self.writes.failed(trajectory.id, f"{path}: {type(exc).__name__}: {exc}")
            return None
        if retry:
            logger.debug("the record of %s was written on a retry", trajectory.id)
        self.writes.succeeded(trajectory.id)
        if self.journal is not None:
            self.journal.remove(trajectory.id)
        self.journals.succeeded(trajectory.id)
        return files

    def write_files(self, trajectory: Trajectory, hold: bool) -> list[str]:
        """The local atomic write, then (fail-open) the mirror's copy of exactly those files."""
        assert self.directory is not None
        files = write_record(trajectory, self.directory, decode_spans=self._decode_spans)
        if self.mirror is not None:
            self.mirror.submit(self.directory, trajectory.id, files, hold=hold)
        return files

    # -- reading -----------------------------------------------------------------------------

    def on_disk(self, trajectory_id: str) -> bool:
        """Whether an ended record exists; ids outside the id alphabet never touch the disk."""
        if self.directory is None or not is_trajectory_id(trajectory_id):
            return False
        return document_path(self.directory, trajectory_id).is_file()

    async def written_unended(self, trajectory_id: str) -> bool:
        """Whether the record on disk was written before the trajectory ended (at a shutdown,
        http.md §6), so a harness can be told to finish it rather than that it has ended.

        An unreadable record counts as ended: its finish will report what is wrong with it.
        """
        if not self.on_disk(trajectory_id):
            return False
        assert self.directory is not None
        path = document_path(self.directory, trajectory_id)
        try:
            document = await asyncio.to_thread(read_document, path)
        except (RecordError, OSError):
            return False
        return document.get("ended") is False

    async def load(self, trajectory_id: str) -> Trajectory:
        """The trajectory of a record on disk, to end or rewrite it (RecordError, OSError)."""
        assert self.directory is not None
        try:
            return await asyncio.to_thread(_load_complete, self.directory, trajectory_id)
        except (RecordError, OSError) as exc:
            logger.warning("reading the record of %s failed: %s", trajectory_id, exc)
            raise

    async def document_bytes(self, trajectory_id: str) -> bytes:
        """The stored document as written, as JSON bytes (RecordError, OSError)."""
        assert self.directory is not None
        path = document_path(self.directory, trajectory_id)
        return await asyncio.to_thread(_stored_document, path)

    # -- where a record is -------------------------------------------------------------------

    def location(self, trajectory_id: str, files: list[str] | None = None) -> dict[str, Any]:
        """The `record` object: host, path, files and the mirror copy's state now."""
        assert self.directory is not None
        if files is None:
            names = [sidecar_name(trajectory_id, kind) for kind in KINDS]
            files = [n for n in names if (self.directory / n).is_file()]
            files.append(document_name(trajectory_id))
        location = {
            "host": self.host(),
            "path": str(self.directory / document_name(trajectory_id)),
            "mirror": None,
            "files": files,
            "mirror_state": None,
            "mirror_error": None,
        }
        if self.mirror is not None:
            location.update(self.mirror.location(trajectory_id, files))
        return location

    def host(self) -> str:
        """`--record-host`, else a non-loopback advertise host, else the primary address."""
        if self._host is None:
            configured = self.options.record_host
            advertised = self.options.advertise_host
            if configured:
                self._host = configured
            elif advertised not in ("127.0.0.1", "::1", "localhost"):
                self._host = advertised
            else:
                self._host = primary_address()
        return self._host


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

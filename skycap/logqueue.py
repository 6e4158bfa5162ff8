"""Log records from the serving loop go through a bounded queue to a writer thread, never to a pipe.

A handler that writes to stderr blocks when whoever reads that pipe (a supervisor, a
container runtime, a CI runner, a soak script) falls behind; on the event loop that would
stop every trajectory. While a server runs, the loggers that log on its loop hand their
records to a bounded queue (the standard library's QueueHandler) and one thread (its
QueueListener) passes them to the root logger's handlers as they are then, as propagation
would. A full queue drops the record and counts it; the thread writes one "N log lines
dropped" line before the next record it writes. docs/serving.md "Logs" says what users see.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from logging.handlers import QueueHandler, QueueListener

#: The loggers whose records are made on the serving loop (skycap's own, mitmproxy's,
#: the engine client's HTTP stack, and asyncio's slow-callback and task reports).
LOOP_LOGGERS = ("skycap", "mitmproxy", "httpx", "httpcore", "hpack", "asyncio")
#: Records held while the writer thread is stuck; past this they are dropped and counted.
CAPACITY = 4096
#: How long stopping waits for the writer thread to write what is queued.
STOP_TIMEOUT = 5.0

_logger = logging.getLogger("skycap.logqueue")


class _DroppingHandler(QueueHandler):
    """Queues a record without waiting; counts the ones a full queue refuses."""

    def __init__(self, records: queue.Queue[logging.LogRecord | None]) -> None:
        super().__init__(records)
        self._lock_dropped = threading.Lock()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        """A record no root handler would take is not formatted or queued at all."""
        return record.levelno >= _lowest_root_level() and bool(super().filter(record))

    def enqueue(self, record: logging.LogRecord) -> None:
        # Which handlers it met is read now, on the logging thread: by the time the writer
        # thread gets to it, stopping may have made the loggers propagate again.
        record.skycap_reached = _reached(record.name)
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            with self._lock_dropped:
                self.dropped += 1

    def take_dropped(self) -> int:
        with self._lock_dropped:
            dropped, self.dropped = self.dropped, 0
        return dropped


class _ToRootHandlers(logging.Handler):
    """On the writer thread: what the root logger's handlers would have done with the record."""

    def __init__(self, source: _DroppingHandler) -> None:
        super().__init__()
        self.source = source

    def emit(self, record: logging.LogRecord) -> None:
        dropped = self.source.take_dropped()
        if dropped:
            _to_root(_dropped_record(dropped))
        _to_root(record, getattr(record, "skycap_reached", ()))


class LogQueue:
    """The installed queue: `install_log_queue()` makes or shares it and
    `uninstall_log_queue()` undoes it when the last user is gone. One per process, shared
    by every server in it."""

    _current: LogQueue | None = None
    _users = 0
    _guard = threading.Lock()

    def __init__(self) -> None:
        self.records: queue.Queue[logging.LogRecord | None] = queue.Queue(CAPACITY)
        self.handler = _DroppingHandler(self.records)
        self.listener = QueueListener(self.records, _ToRootHandlers(self.handler))
        self._propagate: dict[str, bool] = {}

    def _start(self) -> None:
        for name in LOOP_LOGGERS:
            log = logging.getLogger(name)
            self._propagate[name] = log.propagate
            log.addHandler(self.handler)
            log.propagate = False
        self.listener.start()

    def _stop(self) -> None:
        for name, propagate in self._propagate.items():
            log = logging.getLogger(name)
            log.removeHandler(self.handler)
            log.propagate = propagate
        thread = self.listener._thread
        if thread is not None:
            try:  # the sentinel waits behind what is queued; a stuck reader is given up on
                self.records.put(self.listener._sentinel, timeout=STOP_TIMEOUT)
            except queue.Full:
                pass
            thread.join(STOP_TIMEOUT)
            self.listener._thread = None
        dropped = self.handler.take_dropped()
        if dropped:
            _to_root(_dropped_record(dropped))

    def flush(self, timeout: float = STOP_TIMEOUT) -> bool:
        """Wait until every queued record is written; False if that took past `timeout`."""
        done = threading.Event()

        def wait() -> None:
            self.records.join()
            done.set()

        threading.Thread(target=wait, name="skycap-log-flush", daemon=True).start()
        return done.wait(timeout)


def install_log_queue() -> LogQueue:
    """Route the loop's loggers through the queue (idempotent; counted per caller)."""
    with LogQueue._guard:
        if LogQueue._current is None:
            LogQueue._current = LogQueue()
            LogQueue._current._start()
        LogQueue._users += 1
        return LogQueue._current


def uninstall_log_queue() -> None:
    """One caller is done; the last one writes what is queued and puts the loggers back."""
    with LogQueue._guard:
        LogQueue._users -= 1
        if LogQueue._users > 0 or LogQueue._current is None:
            return
        current, LogQueue._current = LogQueue._current, None
    current._stop()


def flush_log_queue(timeout: float = STOP_TIMEOUT) -> bool:
    """Wait until what was logged so far is written (True when nothing is installed)."""
    current = LogQueue._current
    return True if current is None else current.flush(timeout)


def _lowest_root_level() -> int:
    handlers = logging.getLogger().handlers
    if not handlers:
        return logging.lastResort.level if logging.lastResort is not None else logging.CRITICAL
    return min(h.level for h in handlers)


def _reached(name: str) -> list[logging.Handler]:
    """The handlers a record of logger `name` already met on its way up to the queue: a
    handler attached to a non-propagating logger as well as to the root (as pytest's log
    capture is) must not get it twice."""
    reached: list[logging.Handler] = []
    log: logging.Logger | None = logging.getLogger(name)
    while log is not None:
        reached.extend(log.handlers)
        if not log.propagate:
            break
        log = log.parent
    return reached


def _to_root(record: logging.LogRecord, reached: Sequence[logging.Handler] = ()) -> None:
    """Hand a record to the root logger's handlers it has not met yet, or to the last
    resort when the root has none."""
    handlers = logging.getLogger().handlers
    if not handlers and logging.lastResort is not None:
        handlers = [logging.lastResort]
    for handler in handlers:
        if record.levelno >= handler.level and handler not in reached:
            handler.handle(record)


def _dropped_record(count: int) -> logging.LogRecord:
    return _logger.makeRecord(
        _logger.name,
        logging.WARNING,
        __file__,
        0,
        "%d log lines dropped: the log output was not read fast enough (a full pipe)",
        (count,),
        None,
    )

"""Log output never stalls the serving loop: a stuck reader costs dropped lines, not calls."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import fcntl
import logging
import signal
import struct
import termios
import threading
import time

import httpx
import pytest
from server_fixtures import Control, stderr_to_exit, upstream, wait_for
from test_durability import ServeProcess
from test_unwritable import SmallDisk, disk

from skycap.logqueue import (
    CAPACITY,
    LOOP_LOGGERS,
    flush_log_queue,
    install_log_queue,
    uninstall_log_queue,
)


class Stuck(logging.Handler):
    """A root handler whose writes hang until released, as a full pipe's would."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.unblock = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.entered.set()
        self.unblock.wait(30)
        self.messages.append(record.getMessage())


def test_a_stuck_handler_drops_and_counts_instead_of_blocking() -> None:
    stuck = Stuck()
    root = logging.getLogger()
    root.addHandler(stuck)
    install_log_queue()
    log = logging.getLogger("skycap.server")
    try:
        assert all(not logging.getLogger(name).propagate for name in LOOP_LOGGERS)
        log.warning("the first line, which the writer thread is stuck on")
        assert stuck.entered.wait(10)
        started = time.perf_counter()
        for i in range(CAPACITY + 100):
            log.warning("line %d", i)
        assert time.perf_counter() - started < 5  # without the queue: 30 s per line
        stuck.unblock.set()
        assert flush_log_queue()
    finally:
        stuck.unblock.set()
        uninstall_log_queue()
        root.removeHandler(stuck)
    assert all(logging.getLogger(name).propagate for name in LOOP_LOGGERS)
    assert stuck.messages[1] == (
        "100 log lines dropped: the log output was not read fast enough (a full pipe)"
    )
    assert stuck.messages[2] == "line 0" and stuck.messages[-1] == f"line {CAPACITY - 1}"
    assert len(stuck.messages) == CAPACITY + 2


def unread(fd: int) -> int:
    """Bytes waiting in a pipe."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_a_server_whose_stderr_nobody_reads_keeps_serving(upstream, disk: SmallDisk) -> None:
    """`skycap serve` with stderr on a pipe no one reads, an access line per call, and a
    full disk under many trajectories: the pipe fills, `/healthz` still answers at once."""
    if not disk.tmpfs:
        pytest.skip("needs a tmpfs (mount) to fill a disk under another process")
    serve = ServeProcess(
        "--upstream-url", upstream.base_url, "--record-dir", str(disk.dir), "--log-level", "info"
    )
    assert serve.process.stderr is not None
    fd = serve.process.stderr.fileno()
    try:  # a one-page pipe fills after a few dozen access lines
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 4096)
    except OSError:
        pass
    capacity = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    body = {"model": "policy", "messages": [{"role": "user", "content": "hello"}]}
    try:
        with Control(serve.url, serve.token) as control, httpx.Client(timeout=10) as harness:
            created = [control.create() for _ in range(20)]

            def call(one: dict) -> int:
                url = f"{one['base_url']}/chat/completions"
                return harness.post(url, json=body).status_code

            assert all(call(one) == 200 for one in created)
            wait_for(
                lambda: call(created[0]) == 200 and unread(fd) > capacity - 256,
                60,
                "the unread pipe to fill with access lines",
            )
            disk.fill()
            for one in created[1:]:  # every record fails: one episode, queued behind the pipe
                assert control.finish(one["id"]).status_code == 200
            for _ in range(5):
                started = time.perf_counter()
                health = control.http.get("/healthz", timeout=5)
                assert time.perf_counter() - started < 1.0
                assert health.json()["failing_causes"]["record_write"]["trajectories"] == 19
            assert call(created[0]) == 200  # and calls are still answered
            disk.free()
            wait_for(lambda: control.http.get("/healthz").status_code == 200, 20, "the writes")
    finally:
        serve.process.send_signal(signal.SIGTERM)
        stderr = stderr_to_exit(serve.process, timeout=60)  # read at last: the server exits
    assert serve.process.returncode == 0
    # Late, but nothing of the episode is lost: its start and its end were queued.
    assert "ERROR skycap.server: records cannot be written" in stderr
    assert "recovered after" in stderr and "19 trajectories" in stderr


def test_what_is_queued_when_the_queue_stops_is_still_written() -> None:
    """Stopping puts the loggers back before the writer thread drains: a record still
    queued then must reach the root's handlers, not be taken for one they already had
    (a server's last error lines, written at shutdown, were lost this way)."""
    stuck = Stuck()
    root = logging.getLogger()
    root.addHandler(stuck)
    install_log_queue()
    log = logging.getLogger("skycap.server.records")
    stopping = threading.Thread(target=uninstall_log_queue)
    try:
        log.warning("the line the writer thread is stuck on")
        assert stuck.entered.wait(10)
        log.error("records cannot be written: queued behind it")
        stopping.start()
        wait_for(lambda: logging.getLogger("skycap").propagate, 10, "the loggers put back")
        stuck.unblock.set()
        stopping.join(10)
        assert not stopping.is_alive()
    finally:
        stuck.unblock.set()
        if not stopping.is_alive() and not stopping.ident:
            uninstall_log_queue()
        root.removeHandler(stuck)
    assert stuck.messages == [
        "the line the writer thread is stuck on",
        "records cannot be written: queued behind it",
    ]

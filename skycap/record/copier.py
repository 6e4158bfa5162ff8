"""The record mirror's copy step: one file put to the store, run in a child process.

A copy's own Python work (fsspec, s3fs, botocore signing and parsing) is enough to take
the interpreter lock from a capture server's event loop, which showed as a few ms of
added finish latency with the mirror on. So the puts run in one child process
(`python -m skycap.record.copier`) with its own threads; the server's process only pins
files, queues and waits on a pipe. Local stores are copied on threads here instead:
`memory://` lives in this process, and a `file://` copy is the kernel's work, done with
the lock released (and not worth the child's start, about 2.5 s of CPU to import s3fs).
Either way the mirror's `attempts` are the only retries: the store client's own retry loop
(s3fs retries transport errors 5 times) is turned down to one try, so `attempts` means
what it says.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from skycap.record.fsspec_store import CopyFailed

logger = logging.getLogger("skycap.mirror")

# Stores copied on threads in this process (see above); every other one in the child.
IN_PROCESS = frozenset({"memory", "file", "local"})


class CopyTimeout(Exception):
    """A put that did not finish within its timeout; it may still land later."""


class Copier(Protocol):
    def put(self, local: Path, remote: str, timeout: float) -> None: ...
    def hanging(self) -> int: ...
    def close(self, wait: bool) -> None: ...


def put_file(fs: Any, root: str, local: str, remote: str) -> None:
    """One file to the store, making the root folder on a file system that has folders."""
    try:
        fs.put_file(local, remote)
    except FileNotFoundError:
        # file:// needs the prefix made once; object stores have none and never get here.
        fs.makedirs(root, exist_ok=True)
        fs.put_file(local, remote)


def one_try(fs: Any) -> Any:
    """The store client with its own retries off (the mirror's `attempts` retry)."""
    if isinstance(getattr(fs, "retries", None), int):
        fs.retries = 1
    return fs


class ThreadCopier:
    """Each put on its own daemon thread in this process, abandoned past its timeout."""

    def __init__(self, fs: Any, root: str) -> None:
        self._fs, self._root = one_try(fs), root
        self._threads: list[threading.Thread] = []

    def put(self, local: Path, remote: str, timeout: float) -> None:
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                put_file(self._fs, self._root, str(local), remote)
                outcome.append(None)
            except BaseException as exc:  # handed to the waiting caller
                outcome.append(exc)

        thread = threading.Thread(target=run, name="skycap-mirror-copy", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            self._threads.append(thread)
            raise CopyTimeout(f"copy timed out after {timeout:g} s (abandoned)")
        if outcome and outcome[0] is not None:
            raise outcome[0]

    def hanging(self) -> int:
        self._threads = [t for t in self._threads if t.is_alive()]
        return len(self._threads)

    def close(self, wait: bool) -> None:
        """Hanging puts are daemon threads: nothing to wait for."""


class ProcessCopier:
    """Puts sent over a pipe to one child process that copies on `threads` threads.

    The child starts with the copier, so its imports are done by the first finish, and again
    at the next put after it died (its puts in flight then fail as transient, so the mirror
    retries them). It exits when this process closes the pipe, or dies.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any], threads: int) -> None:
        self._setup = {"url": url, "storage_options": dict(storage_options), "threads": threads}
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._send: Connection | None = None
        self._pending: dict[int, Future[None]] = {}
        self._abandoned: set[int] = set()
        self._ids = itertools.count()
        self._closed = False
        with self._lock, contextlib.suppress(OSError):  # else the first put tries again
            self._started()

    def put(self, local: Path, remote: str, timeout: float) -> None:
        future: Future[None] = Future()
        with self._lock:
            if self._closed:
                raise CopyFailed("the copy process is closed (server shutting down)", False)
            job = next(self._ids)
            self._pending[job] = future
            try:
                self._started().send((job, str(local), remote))
            except (OSError, ValueError) as exc:
                self._pending.pop(job, None)
                self._stopped(f"could not reach the copy process: {exc}")
                raise CopyFailed(f"the copy process could not be reached: {exc}", True) from None
        try:
            future.result(timeout)
        except FutureTimeout:
            with self._lock:
                if job in self._pending:
                    self._abandoned.add(job)
            raise CopyTimeout(f"copy timed out after {timeout:g} s (abandoned)") from None

    def hanging(self) -> int:
        with self._lock:
            return len(self._abandoned)

    def close(self, wait: bool) -> None:
        """Close the pipe: the child finishes its puts in flight, then exits. With `wait`
        (nothing in flight), wait for that; otherwise they are left to land on their own."""
        with self._lock:
            self._closed = True
            process, send = self._process, self._send
        if send is not None:
            with contextlib.suppress(OSError):
                send.close()
        if process is not None and wait:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    # -- the child's lifecycle (callers hold self._lock) -----------------------------------

    def _started(self) -> Connection:
        if self._send is not None and self._process is not None and self._process.poll() is None:
            return self._send
        process = subprocess.Popen(
            [sys.executable, "-m", "skycap.record.copier"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        assert process.stdin is not None and process.stdout is not None
        send = Connection(os.dup(process.stdin.fileno()), readable=False)
        receive = Connection(os.dup(process.stdout.fileno()), writable=False)
        process.stdin.close()
        process.stdout.close()
        send.send(self._setup)  # credentials travel on the pipe, never in argv
        self._process, self._send = process, send
        threading.Thread(
            target=self._receive, args=(process, receive), name="skycap-mirror-pipe", daemon=True
        ).start()
        return send

    def _receive(self, process: subprocess.Popen[bytes], receive: Connection) -> None:
        """Resolve each put as its answer comes back; when the child goes, fail the rest."""
        while True:
            try:
                job, error, transient = receive.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.pop(job, None)
                self._abandoned.discard(job)
            if future is not None:
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(CopyFailed(error, transient))
        receive.close()
        code = process.wait()
        with self._lock:
            if self._process is process:
                self._stopped(f"the copy process exited with status {code}")

    def _stopped(self, why: str) -> None:
        """The child is gone: its puts in flight fail as transient; the next put restarts it."""
        if not self._closed:
            logger.warning("record mirror: %s; puts in flight are retried", why)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(CopyFailed(why, True))
        self._pending.clear()
        self._abandoned.clear()
        if self._send is not None:
            with contextlib.suppress(OSError):
                self._send.close()
        self._process = self._send = None


def open_copier(
    url: str, storage_options: Mapping[str, Any], fs: Any, root: str, threads: int
) -> Copier:
    """A child-process copier, or threads here for a local store."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if IN_PROCESS & set(protocols):
        return ThreadCopier(fs, root)
    return ProcessCopier(url, storage_options, threads)


# -- the child process ---------------------------------------------------------------------


def _serve(receive: Connection, send: Connection, describe: Callable[[BaseException], Any]) -> None:
    from skycap.record.fsspec_store import open_store

    setup = receive.recv()
    fs, root = open_store(setup["url"], setup["storage_options"])
    one_try(fs)
    lock = threading.Lock()

    def copy(job: int, local: str, remote: str) -> None:
        try:
            put_file(fs, root, local, remote)
            answer: tuple[int, str | None, bool] = (job, None, False)
        except Exception as exc:
            answer = (job, *describe(exc))
        with lock:
            send.send(answer)

    with ThreadPoolExecutor(setup["threads"], thread_name_prefix="skycap-copy") as pool:
        while True:
            try:
                job, local, remote = receive.recv()
            except (EOFError, OSError):
                break  # the server closed the pipe or died
            pool.submit(copy, job, local, remote)


def main() -> None:
    from skycap.record.fsspec_store import error_text, transient

    # The pipe to the server is a copy of stdout; stdout itself goes to stderr, so nothing a
    # library prints can corrupt the pipe.
    send = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    receive = Connection(os.dup(0), writable=False)
    logging.basicConfig(level=logging.WARNING)
    _serve(receive, send, lambda exc: (error_text(exc), transient(exc)))


if __name__ == "__main__":
    main()

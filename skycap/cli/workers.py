"""The `skycap serve --workers N` supervisor: N server processes on consecutive ports, one shutdown.

One `skycap serve` is one mitmproxy event loop, so one core (docs/scaling.md). The supervisor
starts N ordinary `skycap serve` processes on ports `--port`…`--port+N-1` (proxy ports
likewise), all sharing the record directory, the mirror and one control token,
waits until each answers `/healthz` as up (not starting), and prints every URL.
SIGINT/SIGTERM are forwarded to every worker, and the supervisor returns only once each has
written its records. A worker that dies is reported and the others keep serving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from skycap.control_token import new_control_token
from skycap.record.journal import replay_journals
from skycap.server.control import WORKER_PORTS_VARIABLE
from skycap.server.records import JOURNALS_REPLAYED_VARIABLE

#: The variable through which the supervisor hands its one control token to every worker.
TOKEN_VARIABLE = "SKYCAP_WORKERS_CONTROL_TOKEN"
START_TIMEOUT = 120.0
#: A worker's exit status when records could not be written.
RECORDS_LOST = 3


@dataclass
class Worker:
    index: int
    url: str
    process: subprocess.Popen[bytes]
    reported: bool = False


def strip_workers(argv: Sequence[str]) -> list[str]:
    """The serve arguments without `--workers N` / `--workers=N` (each worker is one server)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            out.append(arg)
    return out


def worker_argv(
    serve_argv: Sequence[str], port: int, proxy_port: int | None, token_from_env: bool
) -> list[str]:
    """One worker's command line: the user's flags, then its own ports (the last wins)."""
    argv = [sys.executable, "-m", "skycap.cli.main", "serve", *serve_argv, "--port", str(port)]
    if proxy_port is not None:
        argv += ["--proxy-port", str(proxy_port)]
    if token_from_env:
        argv += ["--control-token-env", TOKEN_VARIABLE]
    return argv


def _url(host: str, port: int) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def supervise(
    argv: Sequence[str],
    *,
    workers: int,
    host: str,
    port: int,
    proxy_port: int | None,
    control_token_given: bool,
    control_token_off: bool,
    record_dir: Path | None,
) -> int:
    """Run `workers` servers until SIGINT/SIGTERM; 0, or 3 if a worker lost records, else 1."""
    serve_argv = strip_workers(argv)
    env = dict(os.environ)
    token_from_env = not (control_token_given or control_token_off)
    if token_from_env:
        env[TOKEN_VARIABLE] = new_control_token()
    if record_dir is not None:
        _replay(record_dir)
        env[JOURNALS_REPLAYED_VARIABLE] = "1"
    urls = [_url(host, port + i) for i in range(workers)]
    env[WORKER_PORTS_VARIABLE] = ",".join(str(port + i) for i in range(workers))
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for worker in pool:
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)

    pool: list[Worker] = []
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i, url in enumerate(urls):
            cmd = worker_argv(
                serve_argv, port + i, None if proxy_port is None else proxy_port + i, token_from_env
            )
            # Each worker gets its own session: a Ctrl-C reaches the supervisor only, which
            # forwards one SIGTERM, so no worker is interrupted twice mid-write.
            process = subprocess.Popen(cmd, env=env, start_new_session=True)
            pool.append(Worker(i, url, process))
        if not _wait_ready(pool, lambda: stopping):
            forward(signal.SIGTERM, None)
        else:
            _announce(pool)
        return _wait_all(pool, lambda: stopping)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _replay(record_dir: Path) -> None:
    """Replay the crash journals once, here, so no two workers replay the same one."""
    replayed = replay_journals(record_dir)
    if replayed.written:
        print(
            f"skycap serve: {len(replayed.written)} trajectories recovered from crash journals "
            f"in {record_dir} (records written with ended: false)",
            file=sys.stderr,
            flush=True,
        )
    for trajectory_id, why in replayed.unreadable.items():
        print(
            f"skycap serve: the journal of {trajectory_id} cannot be replayed: {why}",
            file=sys.stderr,
            flush=True,
        )
    for trajectory in replayed.unwritten:
        print(
            f"skycap serve: the journal of {trajectory.id} could not be written to a record; "
            "it is kept for the next start",
            file=sys.stderr,
            flush=True,
        )


def _wait_ready(pool: list[Worker], stopping: Callable[[], bool]) -> bool:
    """Poll each worker until `/healthz` says it is up; False if one exits first."""
    deadline = time.monotonic() + START_TIMEOUT
    pending = list(pool)
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while pending:
            for worker in list(pending):
                if worker.process.poll() is not None:
                    print(
                        f"skycap serve: worker {worker.index} ({worker.url}) exited at start "
                        f"with status {worker.process.returncode}; stopping the others",
                        file=sys.stderr,
                        flush=True,
                    )
                    worker.reported = True
                    return False
                try:
                    answer = client.get(f"{worker.url}/healthz")
                except httpx.HTTPError:
                    continue
                if not _starting(answer):
                    pending.remove(worker)
            if stopping():
                return False
            if time.monotonic() > deadline:
                if pending:
                    print(
                        "skycap serve: workers did not start within "
                        f"{START_TIMEOUT:g} s: {', '.join(w.url for w in pending)}",
                        file=sys.stderr,
                        flush=True,
                    )
                return not pending
            if pending:
                time.sleep(0.1)  # polling a child process that has no readiness pipe
    return True


def _starting(answer: httpx.Response) -> bool:
    """A server answers `/healthz` while it is still starting (docs/http.md §13), before its
    control token is written where clients find it."""
    try:
        body = answer.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("starting") is True


def _announce(pool: list[Worker]) -> None:
    urls = " ".join(w.url for w in pool)
    print(
        f"skycap: {len(pool)} workers serving: {urls}\nwatch them all: skycap top {pool[0].url}",
        file=sys.stderr,
        flush=True,
    )


def _wait_all(pool: list[Worker], stopping: Callable[[], bool]) -> int:
    """Wait for every worker; report one that dies while the others serve."""
    status = 0
    while any(w.process.poll() is None for w in pool):
        for worker in pool:
            code = worker.process.poll()
            if code is None or worker.reported:
                continue
            worker.reported = True
            status = max(status, _status(code))
            if not stopping():
                alive = sum(1 for w in pool if w.process.poll() is None)
                print(
                    f"skycap serve: worker {worker.index} ({worker.url}) exited with status "
                    f"{code}; its open trajectories are lost unless its journal replays at the "
                    f"next start; {alive} worker(s) still serving",
                    file=sys.stderr,
                    flush=True,
                )
        try:
            # Sleep until a child exits, without reaping it: Popen.poll() must see its status.
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            break
    for worker in pool:
        worker.process.wait()
        if not worker.reported:
            worker.reported = True
            status = max(status, _status(worker.process.returncode))
    return status


def _status(code: int) -> int:
    if code == 0:
        return 0
    return RECORDS_LOST if code == RECORDS_LOST else 1

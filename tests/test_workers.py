"""`skycap serve --workers 2` as a user runs it: the real openai SDK loads both workers, every
call lands in its own trajectory, SIGTERM writes everything, a killed worker is reported while
the other serves, and `skycap top` given one worker shows both."""

from __future__ import annotations

import asyncio
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI
from server_fixtures import record_files

from skycap import CapturePool, load
from skycap.mock.upstream import ScriptedUpstream

START_TIMEOUT = 120.0


def consecutive_free_ports(count: int) -> int:
    """A first port such that it and the next `count - 1` are free now.

    Drawn below the kernel's ephemeral range (where `bind(("", 0))` and outgoing
    connections take their ports), so a server another test process starts meanwhile
    cannot take one of them between this check and the workers' own bind.
    """
    low, _ = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(1024, low - count)
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise AssertionError("no run of free ports")


class Supervisor:
    """A `skycap serve --workers N` process whose stderr lines are read on a thread."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "skycap.cli.main", "serve", *args],
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.put(line)

    def wait_line(self, text: str, timeout: float = START_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.seen:
                if text in line:
                    return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line with {text!r} in {self.seen}")
            try:
                self.seen.append(self.lines.get(timeout=left))
            except queue.Empty:
                continue

    def workers(self) -> list[int]:
        """The worker processes' ids, in start order (the supervisor's children)."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(c) for c in children]

    def stop(self, timeout: float = 60.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as mock:
        yield mock


def start(upstream: ScriptedUpstream, record_dir: Path) -> tuple[Supervisor, list[str]]:
    port = consecutive_free_ports(2)
    supervisor = Supervisor(
        "--upstream-url", upstream.base_url, "--port", str(port), "--record-dir", str(record_dir),
        "--workers", "2",
    )  # fmt: skip
    line = supervisor.wait_line("workers serving:")
    urls = line.split("workers serving:")[1].split()
    assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    return supervisor, urls


async def rollout(pool: CapturePool, task: int, finish: bool = True) -> tuple[str, str]:
    trajectory = await pool.create({"task": task})
    client = AsyncOpenAI(
        base_url=trajectory.base_url, api_key=trajectory.api_key, max_retries=0, timeout=120
    )
    messages: list = [{"role": "user", "content": f"task {task}"}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="m", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        messages.append({"role": "user", "content": "go on"})
    await client.close()
    if finish:
        result = await trajectory.finish({"reward": 1.0})
        assert result.status == "finished" and len(result.samples) == 1
    return trajectory.server, trajectory.id


def test_two_workers_under_load_then_sigterm_writes_everything(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    supervisor, urls = start(upstream, tmp_path)
    try:
        pool = CapturePool(urls)  # each worker's token file, found by port

        async def load_them() -> list[tuple[str, str]]:
            finished = [rollout(pool, i) for i in range(24)]
            left_open = [rollout(pool, 100 + i, finish=False) for i in range(4)]
            return await asyncio.gather(*finished, *left_open)

        done = asyncio.run(load_them())
        assert {server for server, _ in done} == set(urls), "both workers took trajectories"
        top = subprocess.run(
            [sys.executable, "-m", "skycap.cli.main", "top", "--once", urls[0]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert top.returncode == 0, top.stderr
        assert all(url in top.stdout for url in urls), top.stdout
    finally:
        status = supervisor.stop()
    assert status == 0, supervisor.seen
    ids = {i for _, i in done}
    assert record_files(tmp_path) == sorted(f"{i}.json.zst" for i in ids)
    for _, i in done:
        trajectory = load(tmp_path, i)
        assert len(trajectory.document["nodes"]) == 4, "two calls: user, model, user, model"


def test_a_killed_worker_is_reported_and_the_other_serves(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    supervisor, urls = start(upstream, tmp_path)
    try:
        pool = CapturePool(urls)

        async def hold() -> list[tuple[str, str]]:
            return await asyncio.gather(*(rollout(pool, i, finish=False) for i in range(2)))

        held = asyncio.run(hold())
        assert {server for server, _ in held} == set(urls)
        victim = supervisor.workers()[1]
        os.kill(victim, signal.SIGKILL)
        line = supervisor.wait_line(f"worker 1 ({urls[1]}) exited")
        assert "1 worker(s) still serving" in line
        lost = pool.open_trajectories()[urls[1]]
        assert lost == [i for server, i in held if server == urls[1]]

        async def after() -> tuple[str, str]:
            return await rollout(pool, 9)  # the pool skips the dead worker

        server, _ = asyncio.run(after())
        assert server == urls[0]
    finally:
        status = supervisor.stop()
    assert status == 1, "a dead worker fails the supervisor's exit status"
    kept = [i for server, i in held if server == urls[0]]
    assert set(kept) <= {f.removesuffix(".json.zst") for f in record_files(tmp_path)}
    assert f"{lost[0]}.json.zst" not in record_files(tmp_path)
    # The next start replays the dead worker's crash journal once, in the supervisor.
    again, _ = start(upstream, tmp_path)
    try:
        again.wait_line("1 trajectories recovered from crash journals")
    finally:
        assert again.stop() == 0
    recovered = load(tmp_path, lost[0])
    assert recovered.document["ended"] is False and len(recovered.document["nodes"]) == 4

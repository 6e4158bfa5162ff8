"""Soak: 256 concurrent trajectories against `skycap serve` for a set time, with faults injected.

Faults, in turn every `--fault-every` seconds: upstream resets (streams cut mid-answer),
`kill -9` of the server followed by a restart on the same record directory (its crash
journals replayed), a full disk for `--disk-seconds` (a tmpfs filled, then freed; only
when this process may mount one), a slow upstream (calls wait seconds), and a stalled
reader: the soak stops reading the server's output for 10 s, so its pipe fills (at the
default `--log-level info` each call writes an access line). Each trajectory runs turns
until the time is up, then is finished with a reward; a trajectory whose server was killed
is finished after the restart (its record was rebuilt from the journal).

Every child's output is drained to a file named at the end. A thread asks `/healthz` every
0.5 s through the whole run (scripts/soak_watch.py); its p50, p99 and worst latency are
printed, and the log lines each full disk produced (access lines left out).

With `--workers N` the server is `skycap serve --workers N` and the kill is `kill -9` of
one worker (never the last one alive): the supervisor reports it, the others keep serving
and take the new trajectories. At the end the supervisor gets SIGTERM; if a worker was
killed, the supervisor is started once more on the same record directory, which replays
the dead workers' crash journals, and their trajectories are finished there.

At the end the server gets SIGTERM and every record is read back. It prints calls
answered vs recorded, records lost and the server's resident memory over time (with
workers: the sum over the live workers), then the targets (0 records lost, 0 calls
answered but not recorded, `/healthz` never over 1 s and p99 under 100 ms, under 20 log
lines per full disk, resident memory at the end within 10% of its value after warm-up;
docs/performance.md "Soak with faults"); the exit status is 1 when one is missed.

Usage: uv run python scripts/soak.py [--seconds 120] [--trajectories 256] [--fault-every 15]
       [--workers N] [--disk-seconds 30] [--log-level info]
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from soak_watch import Drain, HealthProbe

from skycap.mock.upstream import ScriptedUpstream
from skycap.record.reader import RecordError, read_document

URL_LINE = re.compile(r"listening on (http://\S+)")
WORKERS_LINE = "workers serving:"
#: The variable the soak hands its control token through (`--control-token-env`), so a
#: restarted server, and every worker, keeps the same one.
TOKEN_VARIABLE = "SKYCAP_SOAK_CONTROL_TOKEN"
ENV = {**os.environ, "SKYCAP_UPSTREAM_API_KEY": "sk-soak", TOKEN_VARIABLE: secrets.token_hex(16)}
#: How long the `stall` fault stops reading the server's output.
STALL_SECONDS = 10.0
#: A server process's resident memory "after warm-up" is taken this long after it started
#: (or after the last kill): long enough for its bounded rings and caches to fill.
WARM_UP = 120.0


class Server:
    """`skycap serve` as a child process, restarted after each kill on the same port."""

    def __init__(self, upstream: str, record_dir: Path, drain: Drain, log_level: str) -> None:
        self.args = [
            "--upstream-url", upstream, "--record-dir", str(record_dir),
            "--control-token-env", TOKEN_VARIABLE, "--log-level", log_level,
        ]  # fmt: skip
        self.drain = drain
        self.process: subprocess.Popen[str] | None = None
        self.port = 0
        self.up = asyncio.Event()
        self.kills = 0

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port}"]

    def live(self, url: str) -> bool:
        """Always: after a kill the server comes back on the same port (wait on `up`)."""
        return True

    def start(self) -> None:
        command = [sys.executable, "-m", "skycap.cli.main", "serve", "--port", str(self.port)]
        after = len(self.drain.lines)
        process = self.process = _spawn([*command, *self.args])
        self.drain.follow(process)
        line = self.drain.wait_line("listening on", 180, lambda: process.poll() is not None, after)
        if line is None:
            raise SystemExit(f"skycap serve did not start; its output is in {self.drain.path}")
        match = URL_LINE.search(line)
        assert match is not None
        self.port = int(match.group(1).rsplit(":", 1)[1])
        self.up.set()

    async def fault(self) -> None:
        self.kill()
        await asyncio.to_thread(self.start)

    def kill(self) -> None:
        assert self.process is not None
        self.up.clear()
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.kills += 1

    def rss_mib(self) -> float:
        return _rss_mib(self.process.pid) if self.process is not None else 0.0

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=300)


class Workers:
    """`skycap serve --workers N` as a child process; faults kill one worker with `kill -9`."""

    def __init__(
        self, upstream: str, record_dir: Path, workers: int, drain: Drain, log_level: str
    ) -> None:
        self.args = [
            "--upstream-url", upstream, "--record-dir", str(record_dir),
            "--control-token-env", TOKEN_VARIABLE, "--workers", str(workers),
            "--log-level", log_level,
        ]  # fmt: skip
        self.drain = drain
        self.count = workers
        self.port = _free_ports(workers)
        self.urls = [f"http://127.0.0.1:{self.port + i}" for i in range(workers)]
        self.dead: set[str] = set()
        self.up = asyncio.Event()
        self.up.set()  # workers die one at a time and stay dead; the others keep serving
        self.kills = 0
        self.process: subprocess.Popen[str] | None = None
        self.since = 0  # the drain's line count when the supervisor last started

    def live(self, url: str) -> bool:
        return url not in self.dead

    def start(self) -> None:
        """Start the supervisor and wait for its line naming every worker; on new ports if
        another process took one of these since they were found free."""
        for _ in range(3):
            try:
                return self._start()
            except PortTaken:
                self.port = _free_ports(self.count)
                self.urls = [f"http://127.0.0.1:{self.port + i}" for i in range(self.count)]
        raise SystemExit("the supervisor could not get its ports three times")

    def _start(self) -> None:
        command = [sys.executable, "-m", "skycap.cli.main", "serve", "--port", str(self.port)]
        self.since = len(self.drain.lines)
        self.process = _spawn([*command, *self.args])
        self.drain.follow(self.process)
        line = self.wait_line(WORKERS_LINE, timeout=180)
        if line.split(WORKERS_LINE)[1].split() != self.urls:
            raise SystemExit(f"the workers serve elsewhere than expected: {line}")

    def wait_line(self, text: str, timeout: float = 60) -> str:
        """A line of the supervisor's (since it last started) that contains `text`."""
        process = self.process
        gone = lambda: process is not None and process.poll() is not None  # noqa: E731
        line = self.drain.wait_line(text, timeout, gone, self.since)
        if line is None:
            if any("address already in use" in x for x in self.drain.lines[self.since :]):
                raise PortTaken()
            raise SystemExit(f"no line with {text!r} from the supervisor; see {self.drain.path}")
        return line

    def _pids(self) -> list[int]:
        """The workers' process ids, in start order (the supervisor's children)."""
        assert self.process is not None
        pid = self.process.pid
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    async def fault(self) -> None:
        """`kill -9` one live worker, never the last, and wait for the supervisor's report."""
        alive = [i for i, url in enumerate(self.urls) if url not in self.dead]
        if len(alive) < 2:
            print("  (one worker left: no kill)")
            return
        victim = random.choice(alive)
        pid = next(p for p in self._pids() if _port_of(p) == self.port + victim)
        self.dead.add(self.urls[victim])
        os.kill(pid, signal.SIGKILL)
        self.kills += 1
        line = await asyncio.to_thread(self.wait_line, f"worker {victim} ({self.urls[victim]})")
        print(f"  supervisor: {line.rstrip()}")

    def rss_mib(self) -> float:
        """The resident memory of the supervisor and its live workers, summed."""
        assert self.process is not None
        try:
            pids = [self.process.pid, *self._pids()]
        except OSError:
            return 0.0
        return sum(_rss_mib(pid) for pid in pids)

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=300)

    def recover(self) -> str:
        """Start the supervisor again, which replays the dead workers' crash journals; the
        line in which it says how many trajectories it recovered."""
        self.dead.clear()
        self.start()
        said = [x for x in self.drain.lines[self.since :] if "recovered from crash journals" in x]
        return said[0] if said else "no crash journal to replay"


def _spawn(argv: list[str]) -> subprocess.Popen[str]:
    """A server whose stdout and stderr share one pipe, which the soak's Drain reads."""
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV
    )


class PortTaken(Exception):
    """A worker could not listen: another process took its port after it was found free."""


def _free_ports(count: int) -> int:
    """A first port such that it and the next `count - 1` are free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise SystemExit("no run of free ports")


def _port_of(pid: int) -> int:
    """The `--port` a worker process was started with (the last one on its command line)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(argv[len(argv) - 1 - argv[::-1].index(b"--port") + 1])


def _rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(match.group(1)) / 1024 if match else 0.0


class Disk:
    """A tmpfs record directory that can be filled and freed (or a plain one)."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.path = path
        path.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
            capture_output=True,
        )
        self.tmpfs = mounted.returncode == 0
        self.filler = path / "filler"

    def fill(self) -> None:
        with open(self.filler, "ab", buffering=0) as filler:
            try:
                while True:
                    filler.write(bytes(1 << 20))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


class Stats:
    def __init__(self) -> None:
        self.answered: dict[str, list[str]] = {}
        self.errors: dict[str, int] = {}
        self.finished: set[str] = set()
        #: Trajectories of a killed worker, finished once the supervisor has restarted.
        self.deferred: list[str] = []
        self.created = 0
        #: Per full disk: the server's log lines (access lines left out) from the moment
        #: it filled until 10 s after it was freed.
        self.disk_lines: list[list[str]] = []

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


Servers = Server | Workers


async def trajectory_loop(
    server: Servers, stats: Stats, deadline: float, client: httpx.AsyncClient
) -> None:
    """Create, call turn after turn until the deadline, finish; survive the server's faults."""
    while time.monotonic() < deadline:
        await server.up.wait()
        live = [url for url in server.urls if server.live(url)]
        url = live[stats.created % len(live)]
        stats.created += 1
        try:
            created = (
                await client.post(f"{url}/trajectories", json={"meta": {}}, headers=AUTH)
            ).json()
        except httpx.HTTPError:
            stats.error("create")
            await asyncio.sleep(0.2)
            continue
        trajectory_id = created["id"]
        stats.answered[trajectory_id] = []
        messages: list[dict] = []
        for turn in range(random.randint(3, 10)):
            if time.monotonic() > deadline or not server.up.is_set() or not server.live(url):
                break
            messages.append({"role": "user", "content": f"{trajectory_id} turn {turn}"})
            stream = turn % 2 == 1
            body = {"model": "policy", "messages": messages, "stream": stream}
            try:
                response = await client.post(
                    f"{created['base_url']}/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {created['api_key']}"},
                )
            except httpx.HTTPError:
                stats.error("call: connection")
                break
            text = reply_text(response, stream)
            if text is None:
                stats.error(f"call: {response.status_code}")
                messages.pop()
                continue
            stats.answered[trajectory_id].append(text)
            messages.append({"role": "assistant", "content": text})
        if server.live(url):
            await finish(trajectory_id, server, url, stats, client)
        else:
            stats.deferred.append(trajectory_id)


#: Every request to a control route carries the one control token all servers share.
AUTH = {"Authorization": f"Bearer {ENV[TOKEN_VARIABLE]}"}


def reply_text(response: httpx.Response, stream: bool) -> str | None:
    if response.status_code != 200:
        return None
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    if "data: [DONE]" not in response.text:
        return None
    return "".join(
        (event["choices"][0]["delta"].get("content") or "")
        for line in response.text.split("\n\n")
        if line.startswith("data: {")
        for event in [orjson.loads(line[6:])]
        if event["choices"]
    )


async def finish(
    trajectory_id: str, server: Servers, url: str, stats: Stats, client: httpx.AsyncClient
) -> None:
    """Finish, retrying across a restart (the record then comes from the journal)."""
    for _ in range(100):
        await server.up.wait()
        if not server.live(url):
            stats.deferred.append(trajectory_id)
            return
        try:
            response = await client.post(
                f"{url}/trajectories/{trajectory_id}/finish",
                json={"annotations": {"reward": 1.0}},
                headers=AUTH,
            )
        except httpx.HTTPError:
            await asyncio.sleep(0.2)
            continue
        if response.status_code == 200:
            stats.finished.add(trajectory_id)
            return
        stats.error(f"finish: {response.status_code}")
        if response.status_code == 404:  # killed before any call committed: no journal
            return
        await asyncio.sleep(0.5)


async def finish_deferred(server: Servers, stats: Stats) -> None:
    """After the supervisor's restart: finish the killed workers' trajectories."""
    async with httpx.AsyncClient(timeout=120) as client:
        for trajectory_id in stats.deferred:
            url = server.urls[0]
            await finish(trajectory_id, server, url, stats, client)


async def faults(
    server: Servers, upstream: ScriptedUpstream, disk: Disk, stats: Stats, args, deadline: float
) -> None:
    kinds = ["resets", "kill", "disk", "slow", "stall"]
    turn = 0
    while time.monotonic() + args.fault_every < deadline:
        await asyncio.sleep(args.fault_every)
        kind = kinds[turn % len(kinds)]
        turn += 1
        print(f"  fault: {kind}", flush=True)
        if kind == "resets":
            upstream.fail_next("break_stream", times=50)
        elif kind == "slow":
            upstream.fail_next("sleep", times=100, seconds=2.0)
        elif kind == "stall":
            await asyncio.to_thread(server.drain.stall, STALL_SECONDS)
        elif kind == "disk":
            if not disk.tmpfs:
                print("  (no tmpfs: the full-disk fault is skipped)")
                continue
            if time.monotonic() + args.disk_seconds + 10 > deadline:
                print("  (too little time left for a full disk)")
                continue
            mark = server.drain.count()
            await asyncio.to_thread(disk.fill)
            await asyncio.sleep(args.disk_seconds)
            disk.free()
            await asyncio.sleep(10.0)  # a retry writes the held records and ends the episode
            stats.disk_lines.append(server.drain.since(mark))
        else:
            await server.fault()


Sample = tuple[float, float, int, int]


async def memory(server: Servers, samples: list[Sample], start: float, deadline: float) -> None:
    """Every 5 s: (seconds in, resident MiB, server processes alive, kills so far)."""
    while time.monotonic() < deadline:
        alive = sum(1 for url in server.urls if server.live(url))
        samples.append((time.monotonic() - start, server.rss_mib(), alive, server.kills))
        await asyncio.sleep(5.0)


def memory_growth(samples: list[Sample]) -> tuple[float, float, float] | None:
    """(seconds in, MiB) after warm-up and MiB at the end, over the processes alive at the
    end: from the first sample WARM_UP s after the last kill (a restart, or one worker
    fewer); None when that came too late to compare."""
    if not samples:
        return None
    last_kill = samples[-1][3]
    since = [s for s in samples if s[3] == last_kill]
    warm = [s for s in since if s[0] >= since[0][0] + WARM_UP]
    if len(warm) < 2:
        return None
    return warm[0][0], warm[0][1], samples[-1][1]


async def soak(args: argparse.Namespace, server: Servers, upstream, disk, stats, samples) -> None:
    start = time.monotonic()
    deadline = start + args.seconds
    limits = httpx.Limits(max_connections=args.trajectories + 16)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tasks = [trajectory_loop(server, stats, deadline, client) for _ in range(args.trajectories)]
        await asyncio.gather(
            *tasks,
            faults(server, upstream, disk, stats, args, deadline),
            memory(server, samples, start, deadline),
        )


def targets(lost: list[str], answered: int, recorded: int, probe: HealthProbe, stats, samples):
    """docs/performance.md "Soak with faults"'s targets: (what, the figure, whether it holds)."""
    growth = memory_growth(samples)
    rows = [
        ("records lost", f"{len(lost)}", not lost),
        ("calls answered but not recorded", f"{answered - recorded}", answered == recorded),
        ("/healthz worst (under 1 s)", f"{probe.worst() * 1000:.0f} ms", probe.worst() < 1.0),
        ("/healthz p99 (under 100 ms)", f"{probe.at(0.99) * 1000:.1f} ms", probe.at(0.99) < 0.1),
    ]
    for i, lines in enumerate(stats.disk_lines):
        rows.append(
            (f"log lines of full disk {i + 1} (under 20)", f"{len(lines)}", len(lines) < 20)
        )
    if growth is None:
        rows.append(("resident memory", "the last kill came too late to compare", True))
    else:
        at, warm, end = growth
        change = (end - warm) / warm if warm else 0.0
        rows.append(
            (
                "resident memory at the end vs after warm-up (within 10%)",
                f"{warm:.0f} MiB at {at:.0f} s -> {end:.0f} MiB ({change:+.1%})",
                abs(change) <= 0.10,
            )
        )
    return rows


def verify(record_dir: Path, stats: Stats) -> tuple[int, int, list[str]]:
    """(calls answered, answered calls found in records, trajectories with something lost)."""
    answered = recorded = 0
    lost = []
    for trajectory_id, texts in stats.answered.items():
        answered += len(texts)
        try:
            document = read_document(record_dir / f"{trajectory_id}.json.zst")
        except RecordError:
            if texts:
                lost.append(trajectory_id)
            continue
        replies = [
            node["message"].get("content")
            for node in document["nodes"]
            if node["author"] == "model"
            for _ in node["calls"]
        ]
        found = sum(1 for text in texts if text in replies)
        recorded += found
        if found < len(texts):
            lost.append(trajectory_id)
    return answered, recorded, lost


def _rss(seconds: float, mib: float, alive: int, workers: int) -> str:
    """One memory sample; with workers, the sum and how many workers it is over."""
    return f"{seconds:.0f}s {mib:.0f} MiB" + (f" ({alive} live)" if workers else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--fault-every", type=float, default=15.0)
    parser.add_argument("--disk-mib", type=int, default=256, help="tmpfs size for records")
    parser.add_argument(
        "--workers", type=int, default=0, help="run `skycap serve --workers N`; kill workers"
    )
    parser.add_argument(
        "--disk-seconds", type=float, default=30.0, help="how long the disk stays full"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        help="the server's --log-level (info: an access line per call, so a stalled reader "
        "fills the pipe)",
    )
    args = parser.parse_args()
    random.seed(7)
    output = Path(tempfile.mkstemp(prefix="skycap-soak-", suffix=".log")[1])
    drain = Drain(output)
    with tempfile.TemporaryDirectory() as tmp, ScriptedUpstream(chunk_delay=0.002) as upstream:
        disk = Disk(Path(tmp) / "records", args.disk_mib)
        print(
            f"soak: {args.trajectories} trajectories for {args.seconds:g} s, a fault every "
            f"{args.fault_every:g} s, records in {disk.path}"
            + (" (tmpfs)" if disk.tmpfs else " (no tmpfs: no full-disk fault)")
        )
        server: Servers = (
            Workers(upstream.base_url, disk.path, args.workers, drain, args.log_level)
            if args.workers
            else Server(upstream.base_url, disk.path, drain, args.log_level)
        )
        stats = Stats()
        samples: list[Sample] = []
        try:
            server.start()
            probe = HealthProbe(server.urls, AUTH, output.with_suffix(".healthz"))
            probe.start()
            try:
                asyncio.run(soak(args, server, upstream, disk, stats, samples))
            finally:
                probe.stop()
            upstream.clear_faults()
            code = server.stop()
            # A supervisor whose worker died exits 1; its restart must exit 0.
            good = code == (1 if args.workers and server.kills else 0)
            if stats.deferred and isinstance(server, Workers):
                print(f"  supervisor: {server.recover().rstrip()}")
                asyncio.run(finish_deferred(server, stats))
                again = server.stop()
                print(f"  supervisor restarted to replay the journals: exit status {again}")
                good = good and again == 0
            answered, recorded, lost = verify(disk.path, stats)
        finally:
            if server.process is not None and server.process.poll() is None:
                server.process.terminate()  # a supervisor stops its workers on SIGTERM
                server.process.wait(timeout=300)
            disk.unmount()
        tracebacks = drain.text().count("Traceback")
        kills = f"{server.kills} kill -9" + (" of a worker" if args.workers else "")
        print(f"server exit status {code}, {tracebacks} tracebacks, {kills}")
        print(
            f"trajectories {len(stats.answered)}, finished {len(stats.finished)}"
            + (f" ({len(stats.deferred)} after the restart)" if stats.deferred else "")
        )
        print(f"calls answered {answered}, recorded {recorded}")
        print(f"records lost {len(lost)}" + (f": {', '.join(lost[:10])}" if lost else ""))
        print(
            "refused or failed: " + ", ".join(f"{k} {v}" for k, v in sorted(stats.errors.items()))
        )
        unfinished = [i for i in stats.answered if i not in stats.finished]
        if unfinished:
            empty = sum(1 for i in unfinished if not stats.answered[i])
            print(
                f"unfinished {len(unfinished)}, {empty} of them with no answered call (no record)"
            )
        print(
            "server RSS over time: "
            + ", ".join(_rss(t, m, n, args.workers) for t, m, n, _ in samples)
        )
        print(probe.summary())
        for i, lines in enumerate(stats.disk_lines):
            print(f"full disk {i + 1} ({args.disk_seconds:g} s): {len(lines)} log lines")
            for line in lines:
                print(f"    {line.rstrip()[:200]}")
        missed = 0
        for what, figure, holds in targets(lost, answered, recorded, probe, stats, samples):
            print(f"target {'ok    ' if holds else 'MISSED'} {what}: {figure}")
            missed += not holds
        print(f"the servers' output: {output}")
        return 1 if missed or not good or tracebacks else 0


if __name__ == "__main__":
    sys.exit(main())

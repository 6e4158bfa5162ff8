"""Soak: 256 concurrent trajectories against `skycap serve` for a set time, with faults injected.

Faults, in turn every `--fault-every` seconds: upstream resets (streams cut mid-answer),
a slow upstream (calls wait seconds), a full disk for a while (a tmpfs filled, then
freed; only when this process may mount one), and `kill -9` of the server followed by a
restart on the same record directory (its crash journals replayed). Each trajectory runs
turns until the time is up, then is finished with a reward; a trajectory whose server
was killed is finished after the restart (its record was rebuilt from the journal).

At the end the server gets SIGTERM and every record is read back. It prints calls
answered vs recorded, records lost (must be 0; the exit status is 1 otherwise) and the
server's resident memory over time.

Usage: uv run python scripts/soak.py [--seconds 120] [--trajectories 256] [--fault-every 15]
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from skycap.mock.upstream import ScriptedUpstream
from skycap.record.reader import RecordError, read_document

URL_LINE = re.compile(r"listening on (http://\S+)")


class Server:
    """`skycap serve` as a child process; `url` changes on each restart."""

    def __init__(self, upstream: str, record_dir: Path) -> None:
        self.args = ["--upstream-url", upstream, "--record-dir", str(record_dir)]
        self.process: subprocess.Popen[str] | None = None
        self.url = ""
        self.token = ""
        self.up = asyncio.Event()
        self.kills = 0

    def start(self) -> None:
        command = [sys.executable, "-m", "skycap.cli.main", "serve", "--port", "0", *self.args]
        env = {**os.environ, "SKYCAP_UPSTREAM_API_KEY": "sk-soak"}
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        assert self.process.stderr is not None
        while line := self.process.stderr.readline():
            match = URL_LINE.search(line)
            if match:
                self.url = match.group(1)
                break
            print(f"  server: {line.rstrip()}")
        if not self.url:
            raise SystemExit("skycap serve did not start")
        token = re.search(r"control token in (\S+) ", self.process.stderr.readline())
        if token is None:
            raise SystemExit("skycap serve did not say where its control token is")
        self.token = Path(token.group(1)).read_text().strip()
        self.up.set()

    def kill(self) -> None:
        assert self.process is not None
        self.up.clear()
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.kills += 1

    def rss_mib(self) -> float:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except (OSError, AttributeError):
            return 0.0
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        return int(match.group(1)) / 1024 if match else 0.0

    def stop(self) -> tuple[int, str]:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        _, stderr = self.process.communicate(timeout=300)
        return self.process.returncode, stderr


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

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def trajectory_loop(
    index: int, server: Server, stats: Stats, deadline: float, client: httpx.AsyncClient
) -> None:
    """Create, call turn after turn until the deadline, finish; survive the server's restarts."""
    while time.monotonic() < deadline:
        await server.up.wait()
        try:
            created = (
                await client.post(
                    f"{server.url}/trajectories", json={"meta": {}}, headers=auth(server)
                )
            ).json()
        except httpx.HTTPError:
            stats.error("create")
            await asyncio.sleep(0.2)
            continue
        trajectory_id = created["id"]
        stats.answered[trajectory_id] = []
        messages: list[dict] = []
        for turn in range(random.randint(3, 10)):
            if time.monotonic() > deadline or not server.up.is_set():
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
        await finish(trajectory_id, server, stats, client)


def auth(server: Server) -> dict[str, str]:
    """The control token of the server now running (a restart makes a new one)."""
    return {"Authorization": f"Bearer {server.token}"}


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


async def finish(trajectory_id: str, server: Server, stats: Stats, client) -> None:
    """Finish, retrying across a restart (the record then comes from the journal)."""
    for _ in range(100):
        await server.up.wait()
        try:
            response = await client.post(
                f"{server.url}/trajectories/{trajectory_id}/finish",
                json={"annotations": {"reward": 1.0}},
                headers=auth(server),
            )
        except httpx.HTTPError:
            await asyncio.sleep(0.2)
            continue
        if response.status_code == 200:
            stats.finished.add(trajectory_id)
            return
        stats.error(f"finish: {response.status_code}")
        await asyncio.sleep(0.5)


async def faults(server: Server, upstream: ScriptedUpstream, disk: Disk, every: float, deadline):
    kinds = ["resets", "kill", "disk", "slow"]
    turn = 0
    while time.monotonic() + every < deadline:
        await asyncio.sleep(every)
        kind = kinds[turn % len(kinds)]
        turn += 1
        print(f"  fault: {kind}", flush=True)
        if kind == "resets":
            upstream.fail_next("break_stream", times=50)
        elif kind == "slow":
            upstream.fail_next("sleep", times=100, seconds=2.0)
        elif kind == "disk":
            if not disk.tmpfs:
                print("  (no tmpfs: the full-disk fault is skipped)")
                continue
            await asyncio.to_thread(disk.fill)
            await asyncio.sleep(min(5.0, every / 2))
            disk.free()
        else:
            server.kill()
            await asyncio.to_thread(server.start)


async def memory(server: Server, samples: list[tuple[float, float]], start: float, deadline):
    while time.monotonic() < deadline:
        samples.append((time.monotonic() - start, server.rss_mib()))
        await asyncio.sleep(5.0)


async def soak(args: argparse.Namespace, server: Server, upstream, disk, stats, samples) -> None:
    start = time.monotonic()
    deadline = start + args.seconds
    limits = httpx.Limits(max_connections=args.trajectories + 16)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tasks = [
            trajectory_loop(i, server, stats, deadline, client) for i in range(args.trajectories)
        ]
        await asyncio.gather(
            *tasks,
            faults(server, upstream, disk, args.fault_every, deadline),
            memory(server, samples, start, deadline),
        )


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--fault-every", type=float, default=15.0)
    parser.add_argument("--disk-mib", type=int, default=256, help="tmpfs size for records")
    args = parser.parse_args()
    random.seed(7)
    with tempfile.TemporaryDirectory() as tmp, ScriptedUpstream(chunk_delay=0.002) as upstream:
        disk = Disk(Path(tmp) / "records", args.disk_mib)
        print(
            f"soak: {args.trajectories} trajectories for {args.seconds:g} s, a fault every "
            f"{args.fault_every:g} s, records in {disk.path}"
            + (" (tmpfs)" if disk.tmpfs else " (no tmpfs: no full-disk fault)")
        )
        print("  (worker kills need `skycap serve --workers`, not built yet: not injected)")
        server = Server(upstream.base_url, disk.path)
        server.start()
        stats = Stats()
        samples: list[tuple[float, float]] = []
        try:
            asyncio.run(soak(args, server, upstream, disk, stats, samples))
            upstream.clear_faults()
            code, stderr = server.stop()
            answered, recorded, lost = verify(disk.path, stats)
        finally:
            if server.process is not None and server.process.poll() is None:
                server.process.kill()
            disk.unmount()
        tracebacks = stderr.count("Traceback")
        print(f"server exit status {code}, {tracebacks} tracebacks, {server.kills} kill -9")
        print(f"trajectories {len(stats.answered)}, finished {len(stats.finished)}")
        print(f"calls answered {answered}, recorded {recorded}")
        print(f"records lost {len(lost)}" + (f": {', '.join(lost[:10])}" if lost else ""))
        print(
            "refused or failed: " + ", ".join(f"{k} {v}" for k, v in sorted(stats.errors.items()))
        )
        print("server RSS over time: " + ", ".join(f"{t:.0f}s {m:.0f} MiB" for t, m in samples))
        return 1 if lost or answered != recorded or code != 0 or tracebacks else 0


if __name__ == "__main__":
    sys.exit(main())

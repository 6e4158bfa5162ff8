"""What the soak (scripts/soak.py) watches besides the calls: child output, `/healthz` latency.

`Drain` reads a child's output to a file as it comes, so the child never blocks on a full
pipe unless the soak stalls the reader on purpose (the `stall` fault). `HealthProbe` asks
each server's `/healthz` every 0.5 s from a process of its own (not the soak's busy
process, whose delays would be counted as the server's) and keeps every latency.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

#: How often `/healthz` is asked, and how long an answer may take before it counts as lost.
PROBE_EVERY = 0.5
PROBE_TIMEOUT = 5.0
#: The logger of the one line per harness call at `--log-level info` (not a fault's lines).
ACCESS = " skycap.access: "


class Drain:
    """A child's stdout and stderr, line by line, into `path` (appended) and into `lines`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[str] = []
        self.seen = threading.Condition()
        self.flowing = threading.Event()
        self.flowing.set()

    def follow(self, process: subprocess.Popen[str]) -> None:
        """Read `process`'s output on a thread until it ends."""
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        with open(self.path, "a") as out:
            while True:
                self.flowing.wait()  # the stall fault holds the reader here
                line = process.stdout.readline()
                if not line:
                    return
                out.write(line)
                out.flush()
                with self.seen:
                    self.lines.append(line)
                    self.seen.notify_all()

    def stall(self, seconds: float) -> None:
        """Stop reading for `seconds`: the child's pipe fills and its writes would block."""
        self.flowing.clear()
        time.sleep(seconds)
        self.flowing.set()

    def wait_line(
        self, text: str, timeout: float, gone: Callable[[], bool], after: int = 0
    ) -> str | None:
        """The first line past the first `after` that contains `text`; None when `gone()`
        or late."""
        deadline = time.monotonic() + timeout
        with self.seen:
            while True:
                for line in self.lines[after:]:
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or gone():
                    return None
                self.seen.wait(min(left, 1.0))

    def count(self) -> int:
        """Lines so far that are not access lines (what a fault makes the server say)."""
        with self.seen:
            return sum(1 for line in self.lines if ACCESS not in line)

    def since(self, start: int) -> list[str]:
        """The lines, access lines left out, after the first `start` of them."""
        with self.seen:
            return [line for line in self.lines if ACCESS not in line][start:]

    def text(self) -> str:
        with self.seen:
            return "".join(self.lines)


class HealthProbe:
    """`GET /healthz` on every server every 0.5 s from a process of its own (the soak's
    event loop and threads share one GIL, whose waits would be counted as the server's);
    latencies in seconds, with when they were taken."""

    def __init__(self, urls: list[str], headers: dict[str, str], path: Path) -> None:
        self.path = path
        self._stop = multiprocessing.get_context("spawn").Event()
        self._process = multiprocessing.get_context("spawn").Process(
            target=_probe, args=(urls, headers, str(path), self._stop), daemon=True
        )
        self.latencies: list[float] = []
        self.worst_at: list[tuple[float, float, str]] = []
        self.unanswered = 0  # no answer within PROBE_TIMEOUT
        self.down = 0  # refused or cut: a killed server (not yet back) or a dead worker

    def start(self) -> None:
        self._process.start()

    def stop(self) -> None:
        self._stop.set()
        self._process.join(30)
        samples = []
        for line in self.path.read_text().splitlines():
            at, url, latency = line.split()
            if latency == "down":
                self.down += 1
                continue
            if latency == "lost":
                self.unanswered += 1
                latency = str(PROBE_TIMEOUT)
            samples.append((float(latency), float(at), url))
        self.latencies = [latency for latency, _, _ in samples]
        self.worst_at = sorted(samples, reverse=True)[:5]

    def summary(self) -> str:
        if not self.latencies:
            return "/healthz: no answer sampled"
        worst = ", ".join(f"{ms * 1000:.0f} ms at {at:.0f} s" for ms, at, _ in self.worst_at)
        return (
            f"/healthz latency over {len(self.latencies)} samples: p50 {self.at(0.5) * 1000:.1f} "
            f"ms, p99 {self.at(0.99) * 1000:.1f} ms, worst {self.worst() * 1000:.1f} ms "
            f"({worst}); {self.unanswered} unanswered, {self.down} refused or cut by a killed "
            "server"
        )

    def at(self, quantile: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] if ordered else 0.0

    def worst(self) -> float:
        return max(self.latencies, default=0.0)


def _probe(urls: list[str], headers: dict[str, str], path: str, stop: Any) -> None:
    """The probe process: one line per sample, `<seconds in> <url> <latency|down|lost>`."""
    started = time.monotonic()
    with httpx.Client(timeout=PROBE_TIMEOUT, trust_env=False) as client, open(path, "a") as out:
        while not stop.wait(PROBE_EVERY):
            for url in urls:
                began = time.perf_counter()
                try:
                    client.get(f"{url}/healthz", headers=headers)
                except httpx.TimeoutException:
                    result = "lost"
                except httpx.HTTPError:  # refused, or the connection died with a killed server
                    result = "down"
                else:
                    result = f"{time.perf_counter() - began:.6f}"
                out.write(f"{time.monotonic() - started:.3f} {url} {result}\n")
                out.flush()

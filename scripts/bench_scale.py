"""Scale benchmark: `skycap serve --workers N` throughput, added latency and CPU per call.

    HF_HUB_OFFLINE=1 uv run python scripts/bench_scale.py [--quick]

Runs the real `skycap serve --workers N` (one supervisor, N server processes) against a
scripted upstream (text mode) or a scripted vLLM engine with the real Qwen3 tokenizer
(token mode), each in its own process. The load generator is a raw keep-alive
httpx.AsyncClient in this process: it shares the machine's cores with the servers, so the
table reports server CPU per call (utime + stime of every worker, from /proc) beside the
wall rates. Every figure is also given as a ratio against one worker measured in the same
run. Tables:

1. text mode: calls/s, p50/p99 latency through skycap (and the upstream's alone under the
   same load), CPU ms per call, against workers (1, 2) at 64 and 256 concurrent
   trajectories;
2. token mode: turns/s and CPU ms per turn against workers and `--renderer-pool-size`, at
   8k and 64k tokens of history;
3. memory per live trajectory (RSS growth of one worker holding many open trajectories).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from skycap.control_token import ENV as CONTROL_TOKEN_ENV
from skycap.control_token import new_control_token

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
WORDS = "alpha beta gamma delta river stone cloud north apple table window garden".split()


def role(kind: str) -> None:
    """A scripted upstream or engine in this process: print its URL, serve until stdin closes."""
    if kind == "upstream":
        from skycap.mock.upstream import ScriptedUpstream

        server = ScriptedUpstream()
        print(server.start(), flush=True)
    else:
        from skycap.mock.engine import ScriptedEngine
        from skycap.tokens.tokenizer_env import bundled_qwen3_dir

        server = ScriptedEngine(str(bundled_qwen3_dir()))
        print(server.start(), flush=True)
    sys.stdin.read()
    server.stop()


class Child:
    """A process whose first stdout line is its URL; closing stdin stops it."""

    def __init__(self, kind: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--role", kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().strip()

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(30)


def free_ports(count: int) -> int:
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


class Workers:
    """`skycap serve --workers N`; waits for its start line, stops with SIGTERM."""

    def __init__(self, n: int, upstream: str, *extra: str) -> None:
        port = free_ports(n)
        self.urls = [f"http://127.0.0.1:{port + i}" for i in range(n)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "skycap.cli.main", "serve", "--upstream-url", upstream,
             "--port", str(port), "--workers", str(n), "--control-token-env",
             CONTROL_TOKEN_ENV, *extra],
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if "workers serving" in line or "listening on" in line and n == 1:
                break
        else:
            raise RuntimeError("skycap serve --workers did not start")
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        self.pids = [int(c) for c in children] or [pid]

    def cpu(self) -> float:
        total = 0.0
        for pid in self.pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        return total

    def rss(self) -> int:
        return int(Path(f"/proc/{self.pids[0]}/statm").read_text().split()[1]) * PAGE

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(120)


HEADERS = {
    "authorization": f"Bearer {os.environ.setdefault(CONTROL_TOKEN_ENV, new_control_token())}"
}


async def create(client: httpx.AsyncClient, url: str) -> dict:
    reply = await client.post(f"{url}/trajectories", json={"meta": {}}, headers=HEADERS)
    reply.raise_for_status()
    return reply.json()


async def text_load(urls: list[str], concurrency: int, calls: int) -> tuple[float, list[float]]:
    """`concurrency` trajectories, each making `calls` sequential chat calls."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits, trust_env=False) as client:
        created = await asyncio.gather(
            *(create(client, urls[i % len(urls)]) for i in range(concurrency))
        )
        latencies: list[float] = []

        async def one(t: dict) -> None:
            headers = {"authorization": f"Bearer {t['api_key']}"}
            body = {"model": "m", "messages": [{"role": "user", "content": "hi " * 40}]}
            for _ in range(calls):
                start = time.perf_counter()
                reply = await client.post(
                    f"{t['base_url']}/chat/completions", json=body, headers=headers
                )
                latencies.append(time.perf_counter() - start)
                reply.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(one(t) for t in created))
        return time.perf_counter() - start, latencies


async def direct_p50(upstream: str, concurrency: int, calls: int) -> tuple[float, float]:
    """The upstream alone under the same load: the baseline latency skycap adds to."""
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        latencies: list[float] = []
        body = {"model": "m", "messages": [{"role": "user", "content": "hi " * 40}]}

        async def one() -> None:
            for _ in range(calls):
                start = time.perf_counter()
                (await client.post(f"{upstream}/chat/completions", json=body)).raise_for_status()
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one() for _ in range(concurrency)))
        return quantile(latencies, 0.5), quantile(latencies, 0.99)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def words(count: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(count))


async def token_load(urls: list[str], trajectories: int, history: int, turns: int) -> float:
    """Each trajectory opens with ~`history` tokens, then makes `turns` more calls."""
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        created = await asyncio.gather(
            *(create(client, urls[i % len(urls)]) for i in range(trajectories))
        )

        async def one(index: int, t: dict) -> None:
            headers = {"authorization": f"Bearer {t['api_key']}"}
            # About one token per word for these words with the Qwen3 tokenizer.
            messages = [{"role": "user", "content": words(history, index)}]
            for turn in range(turns + 1):
                body = {"model": "m", "messages": messages, "max_tokens": 16}
                reply = await client.post(
                    f"{t['base_url']}/chat/completions", json=body, headers=headers
                )
                reply.raise_for_status()
                messages.append(reply.json()["choices"][0]["message"])
                messages.append({"role": "user", "content": words(200, index + turn)})
                if turn == 0:
                    started.append(time.perf_counter())

        started: list[float] = []
        await asyncio.gather(*(one(i, t) for i, t in enumerate(created)))
        return time.perf_counter() - min(started)


def bench_text(upstream: str, quick: bool) -> None:
    calls = 4 if quick else 10
    print("\n## text mode (calls/s, latency, server CPU per call)\n")
    print("| workers | concurrency | calls/s | ×1 worker | p50 ms | p99 ms | CPU ms/call |")
    print("|---|---|---|---|---|---|---|")
    for concurrency in (64, 256):
        base_p50, base_p99 = asyncio.run(direct_p50(upstream, concurrency, calls))
        print(
            f"| upstream alone | {concurrency} | | | {base_p50 * 1000:.1f} | "
            f"{base_p99 * 1000:.1f} | |"
        )
        one_rate = None
        for n in (1, 2):
            servers = Workers(n, upstream)
            try:
                cpu = servers.cpu()
                wall, latencies = asyncio.run(text_load(servers.urls, concurrency, calls))
                cpu = servers.cpu() - cpu
            finally:
                servers.stop()
            rate = len(latencies) / wall
            one_rate = one_rate or rate
            p50 = quantile(latencies, 0.5) * 1000
            p99 = quantile(latencies, 0.99) * 1000
            print(
                f"| {n} | {concurrency} | {rate:,.0f} | {rate / one_rate:.2f} | {p50:.1f} | "
                f"{p99:.1f} | {cpu / len(latencies) * 1000:.2f} |",
                flush=True,
            )


def bench_tokens(engine: str, quick: bool) -> None:
    trajectories, turns = (4, 2) if quick else (8, 4)
    print("\n## token mode (turns/s after the first call, CPU per turn)\n")
    print("| history | workers | renderer pool | turns/s | ×1 worker, pool 1 | CPU ms/turn |")
    print("|---|---|---|---|---|---|")
    from skycap.tokens.tokenizer_env import bundled_qwen3_dir

    folder = str(bundled_qwen3_dir())
    for history in (8_000, 64_000):
        base = None
        for n, pool in ((1, 1), (1, 2), (2, 1)):
            servers = Workers(
                n, engine, "--mode", "tokens", "--tokenizer", folder, "--renderer", "qwen3",
                "--renderer-pool-size", str(pool),
            )  # fmt: skip
            try:
                cpu = servers.cpu()
                wall = asyncio.run(token_load(servers.urls, trajectories, history, turns))
                cpu = servers.cpu() - cpu
            finally:
                servers.stop()
            rate = trajectories * turns / wall
            base = base or rate
            per_turn = cpu / (trajectories * (turns + 1)) * 1000
            print(
                f"| {history // 1000}k | {n} | {pool} | {rate:.1f} | {rate / base:.2f} | "
                f"{per_turn:.0f} |",
                flush=True,
            )


def bench_memory(upstream: str, quick: bool) -> None:
    count = 200 if quick else 1000
    servers = Workers(1, upstream)
    try:

        async def hold() -> None:
            async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
                for _ in range(count):
                    t = await create(client, servers.urls[0])
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi " * 200}]}
                    headers = {"authorization": f"Bearer {t['api_key']}"}
                    reply = await client.post(
                        f"{t['base_url']}/chat/completions", json=body, headers=headers
                    )
                    reply.raise_for_status()

        before = servers.rss()
        asyncio.run(hold())
        grown = servers.rss() - before
    finally:
        servers.stop()
    print(f"\n## memory\n\nper live text-mode trajectory (one ~200-word call): "
          f"{grown / count / 1024:.1f} KiB RSS ({count} held)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer calls per cell")
    parser.add_argument("--only", choices=["text", "tokens", "memory"], help="one table")
    args = parser.parse_args()
    if args.role:
        role(args.role)
        return
    print(f"# bench_scale: {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}")
    upstream = Child("upstream")
    try:
        if args.only in (None, "text"):
            bench_text(upstream.url, args.quick)
        if args.only in (None, "memory"):
            bench_memory(upstream.url, args.quick)
    finally:
        upstream.stop()
    if args.only in (None, "tokens"):
        engine = Child("engine")
        try:
            bench_tokens(engine.url, args.quick)
        finally:
            engine.stop()


if __name__ == "__main__":
    main()

"""Benchmark: a GRPO group's first calls and a burst of new trajectories in token mode.

The group case: `n` repetitions of one task, each the first call of a new trajectory, at
8k, 32k and 64k-token prompts. The first repetition renders the prompt; with the render
cache (`--render-cache-mib`, on by default) the others reuse it. Each figure is the CPU of
the whole call (body parse, plan, engine request, parse of the reply, commit), the
in-process engine's own time subtracted, median over GROUPS groups of distinct prompts;
the same groups run with the cache off in the same run as the baseline.

The burst case: 32 new trajectories (4 groups of 8) arrive at once on a server whose
renderer pool (8 slots) was built at start, against one that builds slots as the burst
needs them (the behaviour before the pool was built at start); it counts the tokenizer
loads during the burst. Run alone, or as part of scripts/bench_tokens.py (which runs this
script in its own process):

    HF_HUB_OFFLINE=1 uv run python scripts/bench_group.py
    HF_HUB_OFFLINE=1 uv run python scripts/bench_tokens.py --group
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import orjson
from bench_tokens import TOOLS, FakeEngineBackend, qwen3_folder, words

import skycap.tokens.library_renderer as library_renderer
from skycap.dialects.chat import DIALECT as CHAT
from skycap.hashing import bytes_digest
from skycap.trajectory import Trajectory
from skycap.wire import parse_json_body

GROUP_SIZES = (8_000, 32_000, 64_000)
REPETITIONS = 8
GROUPS = 3
BURST_GROUPS = 4
BURST_PROMPT = 8_000
#: Words per 1k Qwen3 tokens of the benchmark's text (measured: about 1k tokens per 990 words).
WORDS_PER_K = 990


def task(tokens: int, seed: int) -> list[dict[str, Any]]:
    """A group's first call: a system prompt and a task of about `tokens` tokens."""
    return [
        {"role": "system", "content": f"You read files (group {seed}). " + words(200, seed)},
        {"role": "user", "content": "Solve this. " + words(tokens * WORDS_PER_K // 1000, seed)},
    ]


async def first_call(
    backend: FakeEngineBackend, messages: list[dict[str, Any]], name: str
) -> float:
    """CPU ms of one new trajectory's first call, from its body to its answer, engine excluded."""
    raw = orjson.dumps({"model": "policy", "messages": messages, "tools": TOOLS})
    traj = Trajectory(name, capture=backend.capture)
    engine = backend.engine_cpu
    cpu = time.process_time()
    bytes_digest(raw)  # the retry cache key the server computes per call
    reply = await backend.call(traj, CHAT.read(parse_json_body(raw)), CHAT)
    spent = time.process_time() - cpu - (backend.engine_cpu - engine)
    assert reply.status == 200, reply.body[:300]
    return spent * 1000


async def bench_group(folder: str) -> dict[int, dict[str, float]]:
    """Per prompt size: the first repetition's CPU ms and the median of repetitions 2..n,
    with the render cache on and off."""
    results: dict[int, dict[str, float]] = {}
    for cache_mib in (256, 0):
        backend = FakeEngineBackend(
            experts=False,
            tokenizer=folder,
            renderer_name="qwen3",
            renderer_pool_size=1,
            render_cache_mib=cache_mib,
        )
        try:
            await first_call(backend, task(2_000, 999), "tr_00000000000000ff")  # warm-up
            for size in GROUP_SIZES:
                firsts, rest = [], []
                for group in range(GROUPS):
                    messages = task(size, 10 * size + group)
                    costs = [
                        await first_call(backend, messages, f"tr_{size:08x}{group:04x}{rep:04x}")
                        for rep in range(REPETITIONS)
                    ]
                    firsts.append(costs[0])
                    rest.extend(costs[1:])
                row = results.setdefault(size, {})
                label = "cached" if cache_mib else "uncached"
                row[f"{label}_first"] = statistics.median(firsts)
                row[f"{label}_rest"] = statistics.median(rest)
                if cache_mib:
                    row["hits"] = backend.settings.cache_counters()["render_cache_hits"]
        finally:
            await backend.close()
    return results


async def _burst(folder: str, built_at_start: bool) -> dict[str, float]:
    """32 new trajectories at once; (wall s, CPU ms per call, tokenizer loads during it)."""
    loads = 0
    load = library_renderer.load_tokenizer

    def counting(name: str) -> Any:
        nonlocal loads
        loads += 1
        return load(name)

    backend = FakeEngineBackend(
        experts=False, tokenizer=folder, renderer_name="qwen3", renderer_pool_size=8
    )
    library_renderer.load_tokenizer = counting  # type: ignore[assignment]
    try:
        started = time.perf_counter()
        if built_at_start:
            await backend.start()
        start_s = time.perf_counter() - started
        loads = 0
        calls = [
            first_call(backend, task(BURST_PROMPT, 500 + group), f"tr_0000ba{group:02x}{rep:08x}")
            for group in range(BURST_GROUPS)
            for rep in range(REPETITIONS)
        ]
        engine = backend.engine_cpu
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*calls)
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu - (backend.engine_cpu - engine)
    finally:
        library_renderer.load_tokenizer = load  # type: ignore[assignment]
        await backend.close()
    return {
        "start_s": start_s,
        "wall_s": wall,
        "cpu_ms_per_call": cpu * 1000 / len(calls),
        "loads": loads,
    }


async def bench_burst(folder: str) -> dict[str, dict[str, float]]:
    return {
        "built at start": await _burst(folder, True),
        "built on demand": await _burst(folder, False),
    }


def print_group(group: dict[int, dict[str, float]], burst: dict[str, dict[str, float]]) -> None:
    print(
        f"GRPO group: {REPETITIONS} repetitions, each a new trajectory's first call; CPU ms "
        f"of the whole call, engine excluded, medians over {GROUPS} groups"
    )
    print(
        f"{'prompt':>8}{'1st':>10}{'2..n':>10}{'2..n/1st':>10}"
        f"{'off: 1st':>11}{'off: 2..n':>11}  target 2..n/1st <= 0.10"
    )
    for size, row in group.items():
        ratio = row["cached_rest"] / row["cached_first"]
        print(
            f"{size // 1000:>7}k{row['cached_first']:>10.1f}{row['cached_rest']:>10.2f}"
            f"{ratio:>10.3f}{row['uncached_first']:>11.1f}{row['uncached_rest']:>11.1f}"
        )
    print()
    print(
        f"burst: {BURST_GROUPS * REPETITIONS} new trajectories at once ({BURST_GROUPS} groups of "
        f"{REPETITIONS}, {BURST_PROMPT // 1000}k-token prompts), renderer pool of 8"
    )
    print(f"{'pool':<18}{'start s':>9}{'burst s':>9}{'CPU ms/call':>13}{'tokenizer loads':>17}")
    for name, row in burst.items():
        print(
            f"{name:<18}{row['start_s']:>9.2f}{row['wall_s']:>9.2f}"
            f"{row['cpu_ms_per_call']:>13.2f}{row['loads']:>17.0f}"
        )


def main() -> None:
    folder = qwen3_folder()
    print_group(asyncio.run(bench_group(folder)), asyncio.run(bench_burst(folder)))


if __name__ == "__main__":
    main()

"""Benchmark: the crash journal's cost per committed call, text and token mode, fsync or not.

It times `Journal.append` exactly as the server calls it after a commit, on the event
loop before the answer: a text-mode turn (a user message and the reply) and a token-mode
turn (about 2,000 new prompt tokens and 500 sampled, with logprobs and routed experts
of 48 layers x top-8), into a record directory on the current filesystem (`--dir`).
It also times `read_journal` of the result (the replay at start).

Usage: uv run python scripts/bench_journal.py [--calls N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from skycap.graph import CLIENT, MODEL, Tokens
from skycap.record.journal import Journal, read_journal
from skycap.trajectory import Trajectory

LAYERS, TOP_K = 48, 8
PROMPT, SAMPLED = 2_000, 500


def _text_turn(trajectory: Trajectory, turn: int) -> None:
    graph = trajectory.graph
    parent = len(graph) - 1 if len(graph) else None
    user = graph.add(
        parent,
        author=CLIENT,
        message={"role": "user", "content": f"turn {turn}: " + "please go on. " * 20},
        match_hash=f"{2 * turn:032x}",
        delta_hash=f"{2 * turn:032x}",
        created_at=time.time(),
    )
    model = graph.add(
        user.id,
        author=MODEL,
        message={"role": "assistant", "content": "Here is the next step. " * 30},
        match_hash=f"{2 * turn + 1:032x}",
        delta_hash=f"{2 * turn + 1:032x}",
        created_at=time.time(),
    )
    model.calls.append(
        {
            "t_start": 1.0,
            "t_end": 2.0,
            "model": "policy",
            "sampling": {"temperature": 1.0},
            "usage": {"prompt_tokens": 100, "completion_tokens": 50},
            "finish_reason": "stop",
            "tools": None,
            "bridged": None,
        }
    )


def _token_turn(trajectory: Trajectory, turn: int, rng: np.random.Generator) -> None:
    _text_turn(trajectory, turn)
    user, model = trajectory.graph[-2], trajectory.graph[-1]
    user.tokens = Tokens(
        ids=rng.integers(0, 151_000, PROMPT, dtype=np.int32),
        experts=rng.integers(0, 128, (PROMPT, LAYERS, TOP_K), dtype=np.uint8),
    )
    model.tokens = Tokens(
        ids=rng.integers(0, 151_000, SAMPLED, dtype=np.int32),
        sampled_start=3,
        logprobs=rng.normal(-1.0, 0.5, SAMPLED),
        experts=rng.integers(0, 128, (SAMPLED, LAYERS, TOP_K), dtype=np.uint8),
    )


def run(directory: Path, mode: str, fsync: bool, calls: int) -> tuple[list[float], float, int]:
    journal = Journal(directory, fsync=fsync)
    trajectory = Trajectory(f"tr_{hash((mode, fsync)) & (2**64 - 1):016x}", capture={"mode": mode})
    journal.open(trajectory)
    rng = np.random.default_rng(1)
    times = []
    for turn in range(calls):
        if mode == "tokens":
            _token_turn(trajectory, turn, rng)
        else:
            _text_turn(trajectory, turn)
        start = time.perf_counter()
        journal.append(trajectory, turn + 1)
        times.append(time.perf_counter() - start)
    lines, arrays = (
        journal.directory / f"{trajectory.id}.jsonl",
        journal.directory / (f"{trajectory.id}.bin"),
    )
    size = lines.stat().st_size + (arrays.stat().st_size if arrays.exists() else 0)
    start = time.perf_counter()
    back = read_journal(directory, trajectory.id)
    replay = time.perf_counter() - start
    assert len(back.graph) == len(trajectory.graph)
    journal.remove(trajectory.id)
    journal.close()
    return times, replay, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        print(f"journal in {tmp}, {args.calls} calls per row")
        print(f"{'mode':<8}{'fsync':<7}{'median':>10}{'p99':>10}{'bytes/call':>12}{'replay':>10}")
        for mode in ("text", "tokens"):
            for fsync in (False, True):
                times, replay, size = run(Path(tmp), mode, fsync, args.calls)
                times.sort()
                p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
                print(
                    f"{mode:<8}{'yes' if fsync else 'no':<7}"
                    f"{statistics.median(times) * 1e6:>8.0f}us{p99 * 1e6:>8.0f}us"
                    f"{size // args.calls:>12,}{replay * 1e3:>8.0f}ms"
                )


if __name__ == "__main__":
    main()

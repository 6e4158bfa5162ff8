"""Benchmark: what `RecordIndex.log_step` costs the training loop's thread for one step.

It fills a RecordLog with a step's attempts as the rollout loop leaves them (mirrored
records of three files each, annotations with a reward and a stop reason, one retry in
sixteen), then times `log_step` without W&B: building `step.json` and writing it to the
record directory, the caller's share. With `--wandb`, a W&B stand-in whose
`log_artifact` returns at once is added, and the time the background worker takes per
version (building the artifact: wandb's `add_reference` per file) is reported too; that
worker shares the GIL with the caller, so its steps are timed after the caller's.

Usage: uv run python scripts/bench_index.py [--rows N] [--steps N] [--dir DIR] [--wandb]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from skycap.client import RecordLocation
from skycap.index import IndexConfig, RecordIndex
from skycap.rollout import AttemptRecord, RecordLog


class QuickRun:
    """A wandb run whose log_artifact returns at once (the worker's side is not timed)."""

    id = "bench001"
    name = "bench"
    offline = True

    def log_artifact(self, artifact: Any, aliases: list[str] | None = None) -> Any:
        return artifact


def fill(log: RecordLog, step: int, rows: int) -> None:
    for n in range(rows):
        trajectory_id = f"tr_{step:06x}{n:010x}"
        files = tuple(f"{trajectory_id}.{kind}.zst" for kind in ("tokens", "experts", "json"))
        log.open(
            AttemptRecord(
                phase="train",
                step=step,
                instance_id=str(n // 8),
                repetition_id=n % 8,
                attempt=1 if n % 16 == 15 else 0,
                prompt_index=n // 8,
                meta={},
                id=trajectory_id,
                status="finished",
                annotations={"reward": 1.0, "stop_reason": "complete", "turns": 7},
                record=RecordLocation(
                    path=f"/data/rec/{trajectory_id}.json.zst",
                    host="10.0.0.5",
                    mirror=f"s3://bucket/run-7/{trajectory_id}.json.zst",
                    files=files,
                    mirror_state="pending",
                ),
                superseded=n % 16 == 14,
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="attempts per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None, help="record directory (temporary)")
    parser.add_argument("--wandb", action="store_true", help="also time the W&B worker")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        record_dir = args.dir or Path(temp)
        index = RecordIndex("bench", record_dir=record_dir)
        times = []
        for step in range(args.steps):
            log = RecordLog()
            fill(log, step, args.rows)
            started = time.perf_counter()
            index.log_step(step, "train", {e.id for e in log.entries() if e.id}, log)
            times.append(time.perf_counter() - started)
        index.close()
        size = (record_dir / "index" / "train" / "step-0.json").stat().st_size
        ms = sorted(t * 1000 for t in times)
        print(
            f"log_step, {args.rows} rows ({size / 1e6:.2f} MB step.json): "
            f"p50 {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms over {args.steps} steps"
        )
        if args.wandb:
            config = IndexConfig(queue_size=args.steps + 1, timeout=600, close_timeout=3600)
            index = RecordIndex(QuickRun(), config=config)
            started = time.perf_counter()
            for step in range(args.steps):
                log = RecordLog()
                fill(log, step, args.rows)
                index.log_step(step, "train", None, log)
            index.close()
            per = (time.perf_counter() - started) / args.steps
            print(
                f"W&B worker: {per:.2f} s per version of {args.rows * 3} references "
                f"({index.stats()['wandb']['logged']} logged)"
            )


if __name__ == "__main__":
    main()

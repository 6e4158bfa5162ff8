"""`skycap.compose`: finished rollouts to training rows (numpy), with policies and metrics.

    batch = compose(results, mode="path", policy=Policy(max_seq_len=32768))
    batch.rows            # TrainingRow: input_ids, loss_mask, logprobs, experts, masks, …
    batch.trajectory_rewards  # per group, per trajectory: the input of GRPO-style advantages
    batch.metrics         # trajectories, rows, trained tokens, forks, unbridged, masked, …

Client side only (never loads mitmproxy). See docs/trainer.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from skycap.compose.batch import Batch
from skycap.compose.policy import MASK_REASONS, Policy, Verdict, decide, outcome_of
from skycap.compose.rows import (
    MODES,
    Source,
    TrainingRow,
    cut,
    graph_rows,
    read_record,
    sample_rows,
)
from skycap.compose.staleness import staleness, version_metrics
from skycap.rollout import RolloutResult

__all__ = ["MASK_REASONS", "MODES", "Batch", "Policy", "TrainingRow", "compose", "outcome_of"]

DEFAULT_POLICY = Policy()


def compose(
    results: Sequence[RolloutResult],
    mode: str = "path",
    *,
    policy: Policy = DEFAULT_POLICY,
    record_dir: str | Path | None = None,
) -> Batch:
    """Rows of every result in `mode`, with `policy` applied and the batch's metrics.

    `path` uses the finish answers alone; `step` and `final` read each trajectory's record
    (from `record_dir`, else the directory its finish named). A result with no finish
    answer contributes no rows (it is counted as masked).
    """
    if mode not in MODES:
        raise ValueError(f"compose mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a skycap.compose.Policy, got {type(policy).__name__}")
    results = list(results)
    for i, r in enumerate(results):
        if not isinstance(r, RolloutResult):
            raise TypeError(f"results[{i}] is a {type(r).__name__}, not a RolloutResult")
    per_result = [_rows(r, mode, record_dir) for r in results]
    # Paths captured: the finish's samples (path rule `all`) are one per root-to-leaf path.
    paths = [0 if r.result is None else len(r.result.samples) for r in results]
    verdicts = decide(results, paths, policy)
    versions = staleness(per_result, policy)
    if policy.stale == "mask":
        verdicts = [
            replace(v, masked="stale") if stale and v.masked is None else v
            for v, stale in zip(verdicts, versions.stale, strict=True)
        ]

    rows: list[list[TrainingRow]] = []
    truncated = dropped = 0
    for r, mine, verdict, stale in zip(results, per_result, verdicts, versions.stale, strict=True):
        if stale and policy.stale == "drop":
            dropped += len(mine)
            rows.append([])
            continue
        kept = []
        for row in mine:
            row.reward = verdict.reward
            row.stop_reason = r.rollout.stop_reason
            if verdict.masked is not None:
                row.loss_mask[:] = 0
                row.masked = verdict.masked
            if policy.max_seq_len is not None and len(row) > policy.max_seq_len:
                if policy.truncation == "drop":
                    dropped += 1
                    continue
                cut(row, policy.max_seq_len)
                truncated += 1
                if policy.truncation == "mask":
                    row.loss_mask[:] = 0
                    row.masked = row.masked or "truncated"
            kept.append(row)
        rows.append(kept)

    flat = [row for mine in rows for row in mine]
    rewards: dict[str, dict[str, float]] = {}
    for r, verdict, stale in zip(results, verdicts, versions.stale, strict=True):
        if stale and policy.stale == "drop":
            continue
        if verdict.masked is None and r.result is not None:
            rewards.setdefault(r.instance_id, {})[r.result.id] = verdict.reward
    metrics = _metrics(results, flat, paths, verdicts, truncated, dropped)
    metrics.update(version_metrics(versions))
    return Batch(mode=mode, rows=flat, metrics=metrics, trajectory_rewards=rewards)


def _rows(result: RolloutResult, mode: str, record_dir: str | Path | None) -> list[TrainingRow]:
    finish = result.result
    if finish is None:
        return []
    source = Source(finish.id, result.instance_id, result.prompt_index, result.repetition_id)
    if mode == "path":
        return sample_rows(source, finish)
    if not finish.samples:  # nothing was captured: there is no record worth reading
        return []
    return graph_rows(source, read_record(finish, record_dir), mode)


def _metrics(
    results: list[RolloutResult],
    rows: list[TrainingRow],
    paths: list[int],
    verdicts: list[Verdict],
    truncated: int,
    dropped: int,
) -> dict[str, float | int]:
    masked = Counter(v.masked for v in verdicts if v.masked is not None)
    zeroed = Counter(v.zeroed for v in verdicts if v.zeroed is not None)
    counted = [v.reward for v in verdicts if v.masked is None]
    unbridged = [r.result.unbridged_calls for r in results if r.result is not None]
    metrics: dict[str, float | int] = {
        "trajectories": len(results),
        "rows": len(rows),
        "trained_rows": sum(1 for row in rows if row.trained_tokens),
        "tokens": sum(len(row) for row in rows),
        "trained_tokens": sum(row.trained_tokens for row in rows),
        "forks": sum(max(p - 1, 0) for p in paths),
        "forked_trajectories": sum(1 for p in paths if p > 1),
        "num_unbridged_trajectories": sum(1 for n in unbridged if n),
        "num_unbridged_calls": sum(unbridged),
        "retried_rollouts": sum(1 for r in results if r.attempts > 1),
        "masked_trajectories": sum(masked.values()),
        "masked_rows": sum(1 for row in rows if row.masked is not None),
        "truncated_rows": truncated,
        "dropped_rows": dropped,
        "reward_mean": sum(counted) / len(counted) if counted else 0.0,
    }
    for reason in MASK_REASONS[:-1]:
        metrics[f"masked/{reason}"] = masked.get(reason, 0)
    for reason in ("context_length", "fork"):
        metrics[f"zero_reward/{reason}"] = zeroed.get(reason, 0)
    return metrics

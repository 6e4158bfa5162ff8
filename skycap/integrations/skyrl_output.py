"""A composed batch as SkyRL's `GeneratorOutput`: plain lists, one row per model call (or path,
or trial), each trajectory's rows contiguous, and a placeholder row for an entry with none.

The rules are those SkyRL's trainer asserts on a generator's output
(`validate_generator_output` and `_validate_step_wise_fields` in
`skyrl/train/utils/trainer_utils.py`) and the layout its own step-wise generator writes
(`skyrl/train/generators/skyrl_gym_generator.py`): per-token rewards with the reward on
the last response token, `is_last_step` as real booleans, per-row generation times.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from skycap.compose import Batch, TrainingRow, outcome_of
from skycap.rollout import RolloutResult

__all__ = ["PLACEHOLDER_TOKEN", "SkyRLTrajectoryID", "generator_output", "trajectory_id_class"]

#: The token id a placeholder row holds (one prompt and one response position, trained never).
PLACEHOLDER_TOKEN = 0


@dataclass
class SkyRLTrajectoryID:
    """SkyRL's `TrajectoryID` when skyrl is not importable: the same fields and string form."""

    instance_id: str
    repetition_id: int

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


_CLASS: list[type] = []


def trajectory_id_class() -> type:
    """skyrl's own `TrajectoryID` where skyrl imports (it brings torch), else the stand-in."""
    if not _CLASS:
        try:
            found = importlib.import_module("skyrl.train.generators.base").TrajectoryID
        except Exception:  # not installed, or its torch is not: the stand-in has its fields
            found = SkyRLTrajectoryID
        _CLASS.append(found)
    return _CLASS[0]


@dataclass
class _Row:
    """One output row before it is laid out: the composed row, or None for a placeholder."""

    entry: int
    row: TrainingRow | None
    masked: str | None = None


def generator_output(
    results: Sequence[RolloutResult],
    batch: Batch,
    trajectory_ids: Sequence[Any],
    times: Sequence[float],
) -> dict[str, Any]:
    """SkyRL's `GeneratorOutput` of one batch: `results[i]` is input entry i (its
    `prompt_index` is i), `trajectory_ids[i]` its id, `times[i]` its wall time."""
    by_entry: list[list[TrainingRow]] = [[] for _ in results]
    for row in batch.rows:
        by_entry[row.prompt_index].append(row)
    laid: list[_Row] = []
    placeholders: dict[str, int] = {}
    for entry, (result, rows) in enumerate(zip(results, by_entry, strict=True)):
        if rows:
            laid += [_Row(entry, row, row.masked) for row in rows]
            continue
        reason = _placeholder_reason(result)
        placeholders[reason] = placeholders.get(reason, 0) + 1
        laid.append(_Row(entry, None, reason))
    shape = _expert_shape(batch.rows)
    out: dict[str, list[Any]] = {
        key: []
        for key in (
            "prompt_token_ids",
            "response_ids",
            "loss_masks",
            "rollout_logprobs",
            "rewards",
            "stop_reasons",
            "is_last_step",
            "trajectory_ids",
            "trajectory_generation_times",
            "env_metrics",
        )
    }
    experts: list[Any] = []
    for k, item in enumerate(laid):
        last = k + 1 == len(laid) or laid[k + 1].entry != item.entry
        result = results[item.entry]
        _lay_out(out, experts, item, result, last, shape)
        out["is_last_step"].append(bool(last))
        out["trajectory_ids"].append(trajectory_ids[item.entry])
        out["trajectory_generation_times"].append(float(times[item.entry]))
    metrics: dict[str, Any] = {f"generate/{key}": value for key, value in batch.metrics.items()}
    metrics["generate/placeholder_rows"] = sum(placeholders.values())
    for reason, count in sorted(placeholders.items()):
        metrics[f"generate/placeholder_rows/{reason}"] = count
    output: dict[str, Any] = {**out, "rollout_metrics": metrics}
    output["rollout_expert_indices"] = experts if shape is not None else None
    return output


def _lay_out(
    out: dict[str, list[Any]],
    experts: list[Any],
    item: _Row,
    result: RolloutResult,
    last: bool,
    shape: tuple[int, ...] | None,
) -> None:
    """Append one row's per-token lists, split at its prompt length."""
    row = item.row
    if row is None:
        ids = np.full(2, PLACEHOLDER_TOKEN, dtype=np.int32)
        mask, logprobs, split = np.zeros(2, dtype=np.int8), np.zeros(2, dtype=np.float32), 1
        reward, stop_reason, routed = result.rollout.reward, result.rollout.stop_reason, None
        metrics: dict[str, Any] = {"skycap_masked": item.masked}
    else:
        ids, mask, logprobs = row.input_ids, row.loss_mask, row.logprobs
        # A row that trains nothing (masked, or whose calls trained in an earlier path) has no
        # response of its own: its last token stands in, so the reward has a place to sit.
        split = min(row.prompt_length, len(row) - 1)
        reward, stop_reason, routed = row.reward, row.stop_reason, row.routed_experts
        metrics = result.rollout.finish_annotations()
        if item.masked is not None:
            metrics["skycap_masked"] = item.masked
    response = len(ids) - split
    rewards = [0.0] * response
    if last:
        rewards[-1] = float(reward)
    out["prompt_token_ids"].append(ids[:split].tolist())
    out["response_ids"].append(ids[split:].tolist())
    out["loss_masks"].append(mask[split:].astype(int).tolist())
    out["rollout_logprobs"].append(logprobs[split:].astype(float).tolist())
    out["rewards"].append(rewards)
    out["stop_reasons"].append(stop_reason)
    out["env_metrics"].append(metrics)
    if shape is not None:
        if routed is None:
            routed = np.zeros((len(ids), *shape), dtype=np.int32)
        experts.append(np.asarray(routed).tolist())


def _placeholder_reason(result: RolloutResult) -> str:
    """Why an entry has no row: how its rollout ended, or `empty` / `truncated` when it
    ended well but left nothing to train (no call captured, or every row dropped)."""
    outcome = outcome_of(result)
    if outcome != "complete":
        return outcome
    finish = result.result
    return "empty" if finish is None or not finish.samples else "truncated"


def _expert_shape(rows: Sequence[TrainingRow]) -> tuple[int, ...] | None:
    """`(layers, k)` of the batch's routed experts, None when no row recorded them."""
    for row in rows:
        if row.routed_experts is not None:
            return tuple(int(n) for n in np.asarray(row.routed_experts).shape[1:])
    return None

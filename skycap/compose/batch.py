"""A composed batch: its rows, its metrics, its groups, and padded arrays for a trainer."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from skycap.compose.rows import TrainingRow

__all__ = ["Batch"]


@dataclass
class Batch:
    """Rows in result order (prompt-major, then each trajectory's rows), and batch metrics.

    `trajectory_rewards[instance_id][trajectory_id]` holds the reward of each trajectory
    that counts for its group (masked ones are left out), after the policies: the input of a
    group-relative advantage (GRPO and the like), one value per rollout however many rows
    it has.
    """

    mode: str
    rows: list[TrainingRow]
    metrics: dict[str, float | int]
    trajectory_rewards: dict[str, dict[str, float]] = field(default_factory=dict)

    def trained(self) -> list[TrainingRow]:
        """Rows with at least one trained token."""
        return [row for row in self.rows if row.trained_tokens]

    def groups(self) -> dict[str, list[TrainingRow]]:
        """Rows by `instance_id` (the prompt), in batch order."""
        out: dict[str, list[TrainingRow]] = defaultdict(list)
        for row in self.rows:
            out[row.instance_id].append(row)
        return dict(out)

    def padded(
        self, pad_token_id: int = 0, rows: Sequence[TrainingRow] | None = None
    ) -> dict[str, np.ndarray]:
        """Right-padded `[rows, longest]` arrays of `rows` (default: the trained rows).

        Keys: `input_ids`, `attention_mask`, `loss_mask`, `logprobs`, `rewards` (`[rows]`),
        and `routed_experts` (`[rows, longest, layers, k]`) when every row has them.
        """
        chosen = self.trained() if rows is None else list(rows)
        width = max((len(r) for r in chosen), default=0)
        count = len(chosen)
        input_ids = np.full((count, width), pad_token_id, dtype=np.int32)
        attention = np.zeros((count, width), dtype=np.int8)
        loss_mask = np.zeros((count, width), dtype=np.int8)
        logprobs = np.zeros((count, width), dtype=np.float32)
        for i, row in enumerate(chosen):
            n = len(row)
            input_ids[i, :n] = row.input_ids
            attention[i, :n] = 1
            loss_mask[i, :n] = row.loss_mask
            logprobs[i, :n] = row.logprobs
        out: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "loss_mask": loss_mask,
            "logprobs": logprobs,
            "rewards": np.array([r.reward for r in chosen], dtype=np.float32),
        }
        experts = [r.routed_experts for r in chosen]
        if chosen and all(e is not None for e in experts):
            shape = experts[0].shape[1:]  # type: ignore[union-attr]
            if all(e.shape[1:] == shape for e in experts):  # type: ignore[union-attr]
                stacked = np.zeros((count, width, *shape), dtype=experts[0].dtype)  # type: ignore[union-attr]
                for i, e in enumerate(experts):
                    stacked[i, : e.shape[0]] = e  # type: ignore[union-attr]
                out["routed_experts"] = stacked
        return out

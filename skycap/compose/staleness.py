"""Policy versions in a batch: which versions sampled its trained tokens, and which rollouts
are too stale to train on (docs/trainer.md "Policy versions").

In asynchronous RL the weights change while rollouts are still generating, so one rollout
may be sampled by several versions; a rollout is as old as its oldest trained token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from skycap.compose.policy import Policy
from skycap.compose.rows import TrainingRow


@dataclass(frozen=True)
class Staleness:
    """The batch's versions (oldest first when `ordered`) and, per rollout, whether it is
    stale."""

    versions: list[str]
    stale: list[bool]
    key: Callable[[str], Any]
    ordered: bool


def staleness(per_result: Sequence[Sequence[TrainingRow]], policy: Policy) -> Staleness:
    """Order the versions the rows report, and judge each rollout against `max_policy_lag`.

    Labels `version_key` cannot read (vLLM's own `"default"`, before any update) are fine
    until a lag is asked for; then they raise ValueError naming the label.
    """
    key = policy.version_key or int
    labels = list(
        dict.fromkeys(
            span["version"] for rows in per_result for row in rows for span in _spans(row)
        )
    )
    stale = [False] * len(per_result)
    try:
        versions = sorted(labels, key=lambda label: _ordered(key, label))
    except ValueError:
        if policy.max_policy_lag is not None:
            raise
        return Staleness(labels, stale, key, ordered=False)
    if policy.max_policy_lag is not None and (versions or policy.current_version):
        current = policy.current_version or versions[-1]
        now = _ordered(key, current)
        for i, rows in enumerate(per_result):
            mine = {span["version"] for row in rows for span in _spans(row)}
            if mine:
                oldest = min(_ordered(key, label) for label in mine)
                stale[i] = now - oldest > policy.max_policy_lag
    return Staleness(versions, stale, key, ordered=True)


def version_metrics(found: Staleness) -> dict[str, Any]:
    """`policy_versions`, `oldest_policy_version`, `newest_policy_version`, `stale_rollouts`.

    The oldest and newest are given as `version_key` reads them (a number for the default
    `int`), so a metrics logger can plot them; they are left out when no version was
    reported or the labels do not order.
    """
    metrics: dict[str, Any] = {
        "policy_versions": len(found.versions),
        "stale_rollouts": sum(found.stale),
    }
    if found.versions and found.ordered:
        metrics["oldest_policy_version"] = found.key(found.versions[0])
        metrics["newest_policy_version"] = found.key(found.versions[-1])
    return metrics


def _spans(row: TrainingRow) -> list[dict[str, Any]]:
    return row.weight_versions or []


def _ordered(key: Callable[[str], Any], label: str) -> Any:
    try:
        return key(label)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"policy version {label!r} cannot be ordered with version_key ({exc}); pass "
            "Policy(version_key=...) that reads these labels"
        ) from None

"""Compose policies: which rollouts and rows train, each a named option with a usual default.

A policy decides per trajectory (errors, timeouts, overlong, forks: from how the rollout
ended and the shape of its graph) and per row (truncation to `max_seq_len`). A masked
trajectory keeps its rows with an all-zero loss mask and the reason, so a trainer sees
what was left out; its reward stays out of its group's baseline.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from skycap.rollout import RolloutResult

__all__ = ["MASK_REASONS", "Policy", "Verdict", "decide", "outcome_of"]

#: Why a trajectory (or a row, for `truncated`) trains nothing.
MASK_REASONS = (
    "error",
    "agent_timeout",
    "context_length",
    "fork",
    "group_error",
    "group_timeout",
    "stale",
    "truncated",
)

_CHOICES = {
    "truncation": ("mask", "cut", "drop"),
    "context_length": ("zero_reward", "mask"),
    "timeouts": ("mask", "train"),
    "errors": ("rollout", "group"),
    "forks": ("allow", "mask", "zero_reward"),
    "stale": ("mask", "drop", "train"),
}


@dataclass(frozen=True)
class Policy:
    """What to train of a batch. Defaults: what a GRPO trainer would do without thinking.

    * `max_seq_len` (None: no limit) and `truncation`: a row longer than `max_seq_len`
      tokens is cut to it and its loss mask zeroed (`"mask"`, the overlong filtering of
      DAPO and prime-rl), cut and still trained on what remains (`"cut"`), or removed
      (`"drop"`).
    * `context_length`: a rollout that ran out of context (stop reason `context_length`,
      or a call the server refused for its length) trains with reward 0
      (`"zero_reward"`) or is masked (`"mask"`).
    * `timeouts`: a rollout that timed out (stop reason `agent_timeout`) is masked
      (`"mask"`) or trains with its reward (`"train"`). `timeout_threshold`: when at least
      this fraction of a group timed out, the whole group is masked (its survivors are the
      fast few, not a fair sample); None never masks a group for timeouts.
    * `errors`: an errored rollout is masked alone (`"rollout"`), or with its whole group
      (`"group"`, the stricter rule some trainers apply).
    * `forks`: for a harness declared append-only, a trajectory with more than one path
      is masked (`"mask"`) or trains with reward 0 (`"zero_reward"`); `"allow"` (default)
      trains every path, for harnesses that compact, resample or fan out by design.
    * `max_policy_lag` (None: no limit), `stale`, `current_version`, `version_key`: a
      rollout whose oldest trained token was sampled more than `max_policy_lag` versions
      before `current_version` (None: the newest version in the batch) is masked
      (`"mask"`), left out with its rows (`"drop"`) or trained anyway (`"train"`); each is
      counted in `stale_rollouts`. `version_key` turns a version label into something that
      orders and subtracts (default `int`, for labels such as "3"); see
      docs/trainer.md "Policy versions".
    """

    max_seq_len: int | None = None
    truncation: str = "mask"
    context_length: str = "zero_reward"
    timeouts: str = "mask"
    timeout_threshold: float | None = None
    errors: str = "rollout"
    forks: str = "allow"
    max_policy_lag: int | None = None
    stale: str = "mask"
    current_version: str | None = None
    version_key: Callable[[str], Any] | None = None

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"Policy.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}"
                )
        size = self.max_seq_len
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"Policy.max_seq_len must be None or an integer >= 1, got {size!r}")
        threshold = self.timeout_threshold
        if threshold is not None and not (
            isinstance(threshold, int | float) and not isinstance(threshold, bool)
        ):
            raise ValueError(
                f"Policy.timeout_threshold must be None or a fraction, got {threshold!r}"
            )
        lag = self.max_policy_lag
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
            raise ValueError(f"Policy.max_policy_lag must be None or an integer >= 0, got {lag!r}")
        if self.current_version is not None and not isinstance(self.current_version, str):
            raise ValueError(
                "Policy.current_version must be None or a version label (a string, as vLLM "
                f"reports it), got {self.current_version!r}"
            )
        if self.version_key is not None and not callable(self.version_key):
            raise ValueError(f"Policy.version_key must be a function, got {self.version_key!r}")
        if threshold is not None and not 0 < threshold <= 1:
            raise ValueError(
                "Policy.timeout_threshold must be in (0, 1] (a fraction of a group), "
                f"got {threshold!r}"
            )


@dataclass(frozen=True)
class Verdict:
    """One trajectory's fate: masked (and why), or trained with `reward` (zeroed, and why)."""

    reward: float
    masked: str | None = None
    zeroed: str | None = None


def outcome_of(result: RolloutResult) -> str:
    """`agent_timeout`, `error`, `context_length` or `complete`.

    A rollout that timed out on its last attempt counts as a timeout, though it also
    carries an error; a finish that was not `finished`, or none at all, is an error.
    """
    rollout, finish = result.rollout, result.result
    if rollout.stop_reason == "agent_timeout":
        return "agent_timeout"
    if result.error is not None or rollout.stop_reason == "error":
        return "error"
    if finish is None or finish.status != "finished":
        return "error"
    if rollout.stop_reason == "context_length" or finish.context_length_exceeded:
        return "context_length"
    return "complete"


def decide(results: Sequence[RolloutResult], paths: Sequence[int], policy: Policy) -> list[Verdict]:
    """A verdict per result; `paths[i]` is how many root-to-leaf paths result i captured."""
    outcomes = [outcome_of(r) for r in results]
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(results):
        groups[r.instance_id].append(i)
    errored = {
        key for key, members in groups.items() if any(outcomes[i] == "error" for i in members)
    }
    timed_out = Counter(
        results[i].instance_id for i, o in enumerate(outcomes) if o == "agent_timeout"
    )
    slow = (
        set()
        if policy.timeout_threshold is None
        else {
            key
            for key, members in groups.items()
            if timed_out[key] >= policy.timeout_threshold * len(members)
        }
    )
    verdicts = []
    for i, r in enumerate(results):
        outcome, reward = outcomes[i], r.rollout.reward
        if outcome == "error":
            verdicts.append(Verdict(reward, masked="error"))
        elif outcome == "agent_timeout" and policy.timeouts == "mask":
            verdicts.append(Verdict(reward, masked="agent_timeout"))
        elif policy.errors == "group" and r.instance_id in errored:
            verdicts.append(Verdict(reward, masked="group_error"))
        elif r.instance_id in slow:
            verdicts.append(Verdict(reward, masked="group_timeout"))
        elif outcome == "context_length" and policy.context_length == "mask":
            verdicts.append(Verdict(reward, masked="context_length"))
        elif paths[i] > 1 and policy.forks == "mask":
            verdicts.append(Verdict(reward, masked="fork"))
        elif outcome == "context_length":
            verdicts.append(Verdict(0.0, zeroed="context_length"))
        elif paths[i] > 1 and policy.forks == "zero_reward":
            verdicts.append(Verdict(0.0, zeroed="fork"))
        else:
            verdicts.append(Verdict(reward))
    return verdicts

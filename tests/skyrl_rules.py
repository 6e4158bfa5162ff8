"""What SkyRL's trainer asserts on a generator's output, in this project's words, for the SkyRL
generator tests; SkyRL's own validator on top where skyrl happens to import; and the
`cfg.skycap` block those tests start a local token-mode server from.

Written from skyrl 0.3.0's `validate_generator_output` and `_validate_step_wise_fields`
(`skyrl/train/utils/trainer_utils.py`) and the layout its step-wise generator writes
(`skyrl/train/generators/skyrl_gym_generator.py`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np

#: The per-row fields SkyRL checks against `response_ids`' length.
PER_ROW = (
    "loss_masks",
    "rewards",
    "rollout_logprobs",
    "stop_reasons",
    "trajectory_ids",
    "rollout_expert_indices",
    "is_last_step",
    "trajectory_generation_times",
    "env_metrics",
)


def token_block(engine_url: str, tokenizer: Path, records: Path) -> dict[str, Any]:
    """A `cfg.skycap` block: one token-mode server in this process (no Ray) on `engine_url`."""
    return {
        "servers": 1,
        "ray": False,
        "upstream_url": engine_url,
        "tokenizer": str(tokenizer),
        "renderer_name": "qwen3",
        "renderer_pool_size": 1,
        "record_dir": str(records),
    }


def key(trajectory_id: Any) -> str:
    return trajectory_id.to_string()


def check_output(output: dict[str, Any], num_prompts: int, *, step_wise: bool = True) -> None:
    """Every rule the trainer applies, then skyrl's own validator when it imports."""
    rows = len(output["response_ids"])
    assert rows >= num_prompts > 0  # every input entry yields at least one row
    if not step_wise:
        assert rows == num_prompts
    assert len(output["prompt_token_ids"]) == rows
    for field in PER_ROW:
        if output.get(field) is not None:
            assert len(output[field]) == rows, field
    for i in range(rows):
        response = output["response_ids"][i]
        assert len(response) >= 1, f"row {i} has no response token"
        assert len(output["loss_masks"][i]) == len(response)
        assert len(output["rollout_logprobs"][i]) == len(response)
        assert len(output["rewards"][i]) == len(response)
        assert set(output["loss_masks"][i]) <= {0, 1}
        assert all(type(t) is int for t in output["prompt_token_ids"][i] + response)
    # Rewards: one list of floats per row (SkyRL's per-token form), nonzero only on a
    # trajectory's last row, at its last response token.
    for i, rewards in enumerate(output["rewards"]):
        assert isinstance(rewards, list) and all(type(r) is float for r in rewards)
        assert not any(rewards[:-1])
        if not output["is_last_step"][i]:
            assert rewards[-1] == 0.0
    check_steps(output)
    experts = output.get("rollout_expert_indices")
    if experts is not None:
        for i, routed in enumerate(experts):  # over prompt + response positions
            total = len(output["prompt_token_ids"][i]) + len(output["response_ids"][i])
            assert len(routed) == total
    assert all(k.startswith("generate/") for k in output["rollout_metrics"])
    for name in ("generate/num_unbridged_trajectories", "generate/num_unbridged_calls"):
        assert name in output["rollout_metrics"]
    skyrl_validator(output, num_prompts, step_wise)


def check_steps(output: dict[str, Any]) -> None:
    """Step-wise fields: real booleans, the last row last, each trajectory's rows contiguous,
    `is_last_step` exactly where the trajectory id changes."""
    last, ids = output["is_last_step"], [key(t) for t in output["trajectory_ids"]]
    assert all(type(x) is bool for x in last)
    assert last[-1] is True
    finished: set[str] = set()
    for i, tid in enumerate(ids):
        assert tid not in finished, f"trajectory {tid} is not contiguous (row {i})"
        if i + 1 < len(ids):
            assert last[i] is (ids[i + 1] != tid)
        if last[i]:
            finished.add(tid)


def skyrl_validator(output: dict[str, Any], num_prompts: int, step_wise: bool) -> None:
    """skyrl's own `validate_generator_output`, where skyrl (and its torch) import."""
    try:
        utils = importlib.import_module("skyrl.train.utils.trainer_utils")
    except Exception:  # skyrl is not installed here: the rules above stand alone
        return
    utils.validate_generator_output(num_prompts, output, step_wise=step_wise)


def full_rows(output: dict[str, Any], i: int) -> np.ndarray:
    return np.array(output["prompt_token_ids"][i] + output["response_ids"][i], dtype=np.int64)

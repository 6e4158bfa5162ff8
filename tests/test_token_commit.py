"""Tests of the token-mode commit: nodes, logprobs, expert rows, placeholders, masks, atomicity."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from skycap.hashing import token_client_delta, token_match, token_model_delta
from skycap.tokens.commit import CommitError, commit_turn
from skycap.tokens.engine import EngineOutput
from skycap.tokens.plan import NewMessage, Plan
from skycap.trajectory import FINISHED, Trajectory

USER = {"role": "user", "content": "qé"}
REPLY = {"role": "assistant", "content": "🙂ok"}
CALL = {"t_start": 10.0, "t_end": 11.0, "model": "policy", "sampling": {"temperature": 1.0}}


def ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def first_plan() -> Plan:
    """A user message [1, 2, 3] and the generation prompt [4] (format.md §6.2's example)."""
    match = token_match(USER, "", "policy")
    return Plan(
        prompt_ids=[1, 2, 3, 4],
        parent=None,
        new=[NewMessage(USER, match, ids(1, 2, 3))],
        scaffold=ids(4),
        bridged=None,
        reused=0,
        routes_from=0,
    )


def rows(positions: range, layers: int = 2, k: int = 2) -> np.ndarray:
    """Expert rows whose values are their absolute positions."""
    return np.repeat(np.asarray(positions, dtype=np.uint8)[:, None, None], layers * k, 2).reshape(
        len(positions), layers, k
    )


def output(**changes: Any) -> EngineOutput:
    base = dict(
        completion_ids=[5, 6, 7],
        logprobs=[-0.5, -0.25, -1.0],
        finish_reason="stop",
        routed_experts=rows(range(6)),
        routed_start=0,
        sampling_mask=[[5, 8], [6], [7, 1, 2]],
    )
    return EngineOutput(**{**base, **changes})


def commit(traj: Trajectory, plan: Plan, out: EngineOutput, **kwargs: Any):
    return commit_turn(traj, plan, out, REPLY, dict(CALL), tools=None, model="policy", **kwargs)


def new_trajectory() -> Trajectory:
    return Trajectory("tr_00000000000000aa", capture={"mode": "tokens"})


def test_commit_builds_the_worked_example_nodes() -> None:
    traj = new_trajectory()
    node = commit(traj, first_plan(), output())
    user, model = traj.graph[0], traj.graph[1]
    assert node is model and model.parent == 0
    assert user.tokens.ids.tolist() == [1, 2, 3] and user.tokens.sampled_start is None
    assert user.tokens.logprobs is None and user.created_at == 10.0
    assert user.delta_hash == token_client_delta(user.match_hash, [1, 2, 3])
    assert model.tokens.ids.tolist() == [4, 5, 6, 7] and model.tokens.sampled_start == 1
    assert model.tokens.logprobs.tolist() == [0.0, -0.5, -0.25, -1.0]
    assert model.tokens.mask_row_lists() == [[5, 8], [6], [7, 1, 2]]
    assert model.match_hash == token_match(REPLY, "", "policy")
    assert model.delta_hash == token_model_delta(
        model.match_hash, {"temperature": 1.0}, 1, [4, 5, 6, 7]
    )
    assert model.created_at == 11.0
    assert model.calls == [{**CALL, "tools": None, "bridged": None}]
    # Rows 0..5 from the engine, the final position a placeholder copy of row 5.
    assert user.tokens.experts[:, 0, 0].tolist() == [0, 1, 2]
    assert model.tokens.experts[:, 0, 0].tolist() == [3, 4, 5, 5]
    assert model.tokens.experts_placeholder and not user.tokens.experts_placeholder


def test_the_next_turn_replaces_the_placeholder_with_the_real_row() -> None:
    traj = new_trajectory()
    commit(traj, first_plan(), output())
    follow = {"role": "user", "content": "more"}
    plan = Plan(
        prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 4],
        parent=1,
        new=[NewMessage(follow, token_match(follow, "", "policy"), ids(8, 9))],
        scaffold=ids(4),
        bridged=True,
        reused=7,
        routes_from=6,
    )
    real = rows(range(6, 11)) + 100  # positions 6..10: from the prefix's last to total - 2
    commit(
        traj,
        plan,
        output(
            completion_ids=[3, 9],
            logprobs=[-1.0, -2.0],
            routed_experts=real,
            routed_start=6,
            sampling_mask=None,
        ),
    )
    previous, new_user, model = traj.graph[1], traj.graph[2], traj.graph[3]
    assert previous.tokens.experts[:, 0, 0].tolist() == [3, 4, 5, 106]
    assert not previous.tokens.experts_placeholder
    assert new_user.parent == 1 and new_user.tokens.experts[:, 0, 0].tolist() == [107, 108]
    assert model.tokens.experts[:, 0, 0].tolist() == [109, 110, 110]
    assert model.tokens.experts_placeholder
    assert model.tokens.mask_offsets is None and model.calls[0]["bridged"] is True


def test_full_coverage_leaves_no_placeholder() -> None:
    traj = new_trajectory()
    commit(traj, first_plan(), output(routed_experts=rows(range(7))))
    model = traj.graph[1]
    assert model.tokens.experts[:, 0, 0].tolist() == [3, 4, 5, 6]
    assert not model.tokens.experts_placeholder


def test_a_node_starting_before_the_returned_rows_gets_none() -> None:
    traj = new_trajectory()
    commit(traj, first_plan(), output(routed_experts=rows(range(2, 6)), routed_start=2))
    assert traj.graph[0].tokens.experts is None
    assert traj.graph[1].tokens.experts[:, 0, 0].tolist() == [3, 4, 5, 5]


def test_zero_length_nodes_get_an_empty_rows_array() -> None:
    traj = new_trajectory()
    empty = {"role": "user", "content": ""}
    plan = first_plan()
    plan.new.append(NewMessage(empty, token_match(empty, "", "policy"), ids()))
    commit(traj, plan, output())
    assert traj.graph[1].tokens.length == 0
    assert traj.graph[1].tokens.experts.shape == (0, 2, 2)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"completion_ids": [], "logprobs": []}, "empty completion"),
        ({"logprobs": [-1.0]}, "3 completion tokens but 1 logprobs"),
        ({"sampling_mask": [[1]]}, "sampling mask has 1 rows for 3 completion tokens"),
        ({"routed_experts": rows(range(11))[:, :, 0]}, "routed experts cover 0\\+11 of 12"),
        ({"routed_experts": rows(range(9))}, "routed experts cover 0\\+9 of 12 positions"),
        ({"routed_experts": rows(range(13))}, "routed experts cover 0\\+13 of 12 positions"),
        ({"routed_start": 2}, "routed experts cover 2\\+11 of 12 positions"),
        ({"routed_experts": rows(range(11), layers=3)}, "\\(layers, k\\) = \\(3, 2\\)"),
    ],
)
def test_commit_errors_leave_the_graph_untouched(changes: dict[str, Any], error: str) -> None:
    traj = new_trajectory()
    commit(traj, first_plan(), output(routed_experts=rows(range(7))))
    before = [(n.id, n.tokens.experts.copy()) for n in traj.graph]
    follow = {"role": "user", "content": "more"}
    plan = Plan(
        prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8, 4],
        parent=1,
        new=[NewMessage(follow, token_match(follow, "", "policy"), ids(8))],
        scaffold=ids(4),
        bridged=True,
        reused=7,
        routes_from=0,
    )
    with pytest.raises(CommitError, match=error):
        commit(
            traj,
            plan,
            output(**{"routed_experts": rows(range(11)), **changes}),
            experts_shape=(2, 2),
        )
    assert [n.id for n in traj.graph] == [i for i, _ in before]
    assert all(np.array_equal(traj.graph[i].tokens.experts, e) for i, e in before)
    assert traj.tools == {} and len(traj.graph[1].calls) == 1


def test_a_plan_that_does_not_add_up_is_refused() -> None:
    plan = first_plan()
    plan.prompt_ids = [1, 2, 3, 4, 9]
    with pytest.raises(CommitError, match="attributes 4 tokens but the prompt has 5"):
        commit(new_trajectory(), plan, output(routed_experts=None))


def test_a_sealed_trajectory_commits_nothing() -> None:
    traj = new_trajectory()
    traj.seal(FINISHED)
    assert commit(traj, first_plan(), output()) is None
    assert len(traj.graph) == 0


def test_an_identical_turn_adds_a_call_to_the_same_nodes() -> None:
    traj = new_trajectory()
    first = commit(traj, first_plan(), output())
    second = commit(traj, first_plan(), output())
    assert first is second and len(traj.graph) == 2 and len(first.calls) == 2


def test_tools_are_registered_and_keyed_on_the_call() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    traj = new_trajectory()
    node = commit_turn(traj, first_plan(), output(), REPLY, dict(CALL), tools=tools, model="policy")
    (key,) = traj.tools
    assert node.calls[0]["tools"] == key and traj.tools[key] == tools
    assert node.match_hash == token_match(REPLY, key, "policy")

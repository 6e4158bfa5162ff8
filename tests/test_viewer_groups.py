"""Group rules of viewer.md §4 on hand-made summaries: keys, attempts, modal size, sorts."""

from __future__ import annotations

from typing import Any

from skycap.viewer.groups import Query, build_groups, groups_table, parse_query, rollouts_table
from skycap.viewer.index import Summary


def summary(
    id: str, *, created: float = 0.0, flags: list[str] | None = None, **meta: Any
) -> Summary:
    annotations = meta.pop("annotations", {})
    return Summary(
        id=id,
        stamp=(0, 0),
        status="finished",
        created_at=created,
        meta=meta,
        annotations=annotations,
        flags=flags or [],
        search=id,
    )


def test_keys_come_from_meta_then_annotations_and_odd_values_leave_rollouts_ungrouped():
    rollouts = [
        summary("a", step=1, instance_id="x"),
        summary("b", step=1.0, annotations={"instance_id": "x"}),
        summary("c", step=True, instance_id="x"),
        summary("d", step=1, instance_id=None),
        summary("e", step=1, instance_id={"nested": 1}),
        summary("f", step=1),
    ]
    groups = build_groups(rollouts, ("step", "instance_id"))
    assert sorted(groups.groups) == ["1~x", "true~x"]
    assert [s.id for s in groups.groups["1~x"].counting] == ["a", "b"]
    assert [s.id for s in groups.ungrouped] == ["d", "e", "f"]
    assert groups.groupable  # 3 of 6 have a key: at least half


def test_highest_attempt_counts_ties_go_to_the_newer_and_non_numeric_attempts_are_zero():
    rollouts = [
        summary("old", created=1, step=1, instance_id="x", repetition_id=0, attempt=1),
        summary("new", created=2, step=1, instance_id="x", repetition_id=0, attempt=1),
        summary("zero", created=3, step=1, instance_id="x", repetition_id=0, attempt="late"),
        summary("r1", step=1, instance_id="x", repetition_id=1),
    ]
    group = build_groups(rollouts, ("step", "instance_id")).groups["1~x"]
    assert [s.id for s in group.counting] == ["new", "r1"]
    assert [s.id for s in group.superseded["new"]] == ["old", "zero"]
    assert group.flags == ["retried"]


def test_repetitions_without_an_id_are_the_trajectory_and_sort_numerically():
    rollouts = [
        summary(i, step=1, instance_id="x", repetition_id=r)
        for i, r in [("t10", 10), ("t2", 2), ("t1", "1")]
    ]
    group = build_groups(rollouts, ("step", "instance_id")).groups["1~x"]
    assert [s.id for s in group.counting] == ["t1", "t2", "t10"]


def test_modal_size_ties_go_to_the_larger_size_and_boolean_rewards_read_as_numbers():
    rollouts = [
        summary(f"a{r}", step=1, instance_id="a", repetition_id=r, annotations={"reward": True})
        for r in range(3)
    ]
    rollouts += [
        summary(f"b{r}", step=1, instance_id="b", repetition_id=r, annotations={"reward": r})
        for r in range(2)
    ]
    groups = build_groups(rollouts, ("step", "instance_id"))
    assert groups.modal == 3
    assert groups.groups["1~a"].flags == ["no-signal"]
    assert groups.groups["1~b"].flags == ["short"]


def test_no_signal_needs_every_reward_and_masked_only_counts_counting_rollouts():
    rollouts = [
        summary("r0", step=1, instance_id="x", repetition_id=0, annotations={"reward": 1}),
        summary("r1", step=1, instance_id="x", repetition_id=1, annotations={"reward": "1"}),
        summary(
            "s0",
            step=1,
            instance_id="y",
            repetition_id=0,
            attempt=0,
            annotations={"reward": 0, "stop_reason": "agent_timeout"},
        ),
        summary(
            "s1", step=1, instance_id="y", repetition_id=0, attempt=1, annotations={"reward": 1}
        ),
        summary(
            "t0",
            step=1,
            instance_id="z",
            repetition_id=0,
            annotations={"reward": 1, "stop_reason": "error"},
        ),
    ]
    groups = build_groups(rollouts, ("step", "instance_id")).groups
    assert groups["1~x"].flags == []  # "1" is not a numeric reward
    # The superseded attempt's agent_timeout does not mask; modal size is 1 (two groups of 1).
    assert groups["1~y"].flags == ["no-signal", "retried"]
    assert groups["1~z"].flags == ["no-signal", "masked"]


def test_health_sort_counts_group_and_rollout_flags():
    rollouts = [
        summary("a", step=1, instance_id="a", flags=["forked", "truncated"]),
        summary("b", step=1, instance_id="b", flags=["bridged-unknown"]),
        summary("c", step=1, instance_id="c", flags=["failed-calls"]),
    ]
    groups = build_groups(rollouts, ("step", "instance_id"))
    table = groups_table(rollouts, groups, parse_query({"sort": "health"}))
    assert [g["key"] for g in table["groups"]] == ["1~a", "1~c", "1~b"]
    assert table["groups"][0]["rollup"] == {"truncated": 1, "forked": 1}


def test_rollouts_health_sort_puts_errors_first_and_ignores_bridged_unknown():
    rollouts = [
        summary("quiet", flags=["bridged-unknown"]),
        summary("warns", flags=["truncated", "replayed", "forked"]),
        summary("error", flags=["incomplete"]),
    ]
    table = rollouts_table(rollouts, build_groups(rollouts, ("step",)), Query(sort="health"))
    assert [r["id"] for r in table["rows"]] == ["error", "warns", "quiet"]
    assert table["rows"][2]["flags"] == []

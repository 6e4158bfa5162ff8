"""Group rules of docs/viewer.md "Groups" on hand-made summaries: keys, attempts, modal size,
sorts."""

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


def test_reward_colours_span_the_run_and_the_task_filter_reads_raw_meta():
    rollouts = [
        summary("a", task="tasks/alpha.json", annotations={"reward": 0.0}),
        summary("b", task="tasks/alpha.json", annotations={"reward": 0.5}),
        summary("c", task="tasks/beta.json", instance_id="inst-9", annotations={"reward": 1.0}),
    ]
    groups = build_groups(rollouts, ("task",))
    table = rollouts_table(rollouts, groups, parse_query({"task": "tasks/alpha"}))
    assert [r["id"] for r in table["rows"]] == ["a", "b"]
    assert table["reward_range"] == {"min": 0.0, "max": 1.0}  # not the rows' 0..0.5
    assert [
        r["id"] for r in rollouts_table(rollouts, groups, parse_query({"task": "inst-9"}))["rows"]
    ] == ["c"]
    assert [r["task"] for r in table["rows"]] == ["alpha.json", "alpha.json"]
    grouped = groups_table(rollouts, groups, parse_query({"task": "alpha"}))
    assert grouped["reward_range"] == {"min": 0.0, "max": 1.0}


def test_every_column_sorts_and_meta_keys_become_columns():
    rollouts = [
        summary("a", created=1, seed=3, annotations={"stop_reason": "timeout"}),
        summary("b", created=2, seed=10, annotations={"stop_reason": "complete"}),
        summary("c", created=3, seed="x"),
    ]
    rollouts[0].paths, rollouts[1].paths, rollouts[2].paths = 2, 1, 3
    rollouts[0].trainable, rollouts[1].trainable = 5, 9
    rollouts[2].status = "open"
    groups = build_groups(rollouts, ("step",))

    def order(**params: str) -> list[str]:
        return [r["id"] for r in rollouts_table(rollouts, groups, parse_query(params))["rows"]]

    assert order(sort="paths") == ["c", "a", "b"]
    assert order(sort="trainable") == ["b", "a", "c"]  # nulls last
    assert order(sort="status") == ["b", "a", "c"]  # text ascending, ties newest first
    assert order(sort="stop_reason") == ["b", "a", "c"]
    assert order(sort="meta.seed") == ["a", "b", "c"]  # numbers before text
    assert order(sort="meta.seed", order="desc") == ["c", "b", "a"]
    table = rollouts_table(rollouts, groups, parse_query({}))
    assert table["meta_keys"] == ["seed"] and table["rows"][0]["meta"] == {"seed": "x"}
    import pytest

    from skycap.viewer.groups import QueryError

    with pytest.raises(QueryError, match=r"sort by one of .*stop_reason or meta.<key>"):
        parse_query({"sort": "meta."})

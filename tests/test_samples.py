"""Tests of path rules, recorded rows, per-sample arrays and their wire form (graph.md §4, §5)."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from skycap.arrays import rows_to_csr
from skycap.dialects.chat import DIALECT as CHAT
from skycap.graph import CLIENT, MODEL, Graph, Tokens
from skycap.samples import (
    PathRuleFailed,
    Row,
    UnknownPathRule,
    build_rules,
    build_sample,
    encode_sample,
    parse_rule_option,
    resolve_rule,
    rows_all,
    rows_final,
    rows_for_finish,
    rows_from_samples_field,
    samples_field,
)
from skycap.text.commit import commit_text_call
from skycap.trajectory import Trajectory

# graph.md §5, verbatim.
WORKED_EXAMPLE = json.loads("""
{"leaf": 1, "path": [0, 1],
 "messages": [{"role": "user", "content": "qé"}, {"role": "assistant", "content": "🙂ok"}],
 "targets": [1],
 "input_ids": [1, 2, 3, 4, 5, 6, 7],
 "loss_mask": [0, 0, 0, 0, 1, 1, 1],
 "logprobs": [0.0, 0.0, 0.0, 0.0, -0.5, -0.25, -1.0],
 "routed_experts": {"data": "AAAAAAEBAQECAgICAwMDAwQEBAQFBQUFBQUFBQ==", "shape": [7, 2, 2],
                    "dtype": "uint8"},
 "sampling_mask": {"ids": [5, 8, 6, 7, 1, 2], "offsets": [0, 0, 0, 0, 0, 2, 3, 6]},
 "media": []}
""")


def _experts(rows: list[int]) -> np.ndarray:
    return np.repeat(np.array(rows, dtype=np.uint8), 4).reshape(len(rows), 2, 2)


def _add(graph: Graph, parent: int | None, author: str, tokens: Tokens | None = None, **msg: Any):
    node_id = len(graph)
    return graph.add(
        parent,
        author=author,
        message={"role": "assistant" if author == MODEL else "user", **msg},
        match_hash=f"m{node_id}",
        delta_hash=f"d{node_id}",
        created_at=float(node_id),
        tokens=tokens,
    )


def _call(node, t_end: float) -> None:
    node.calls.append({"t_start": t_end - 1, "t_end": t_end, "sampling": {}})


def worked_example_graph() -> Graph:
    """format.md §6.2's two token nodes."""
    graph = Graph()
    _add(graph, None, CLIENT, Tokens(ids=[1, 2, 3], experts=_experts([0, 1, 2])), content="qé")
    ids, offsets = rows_to_csr([[5, 8], [6], [7, 1, 2]])
    model = _add(
        graph,
        0,
        MODEL,
        Tokens(
            ids=[4, 5, 6, 7],
            sampled_start=1,
            logprobs=[0.0, -0.5, -0.25, -1.0],
            experts=_experts([3, 4, 5, 5]),
            mask_ids=ids,
            mask_offsets=offsets,
        ),
        content="🙂ok",
    )
    _call(model, 1.0)
    return graph


def test_worked_example_reproduced_exactly() -> None:
    graph = worked_example_graph()
    [row] = rows_all(graph)
    encoded = encode_sample(build_sample(graph, row.path, row.targets))
    assert encoded == WORKED_EXAMPLE
    assert list(encoded) == list(WORKED_EXAMPLE)  # key order as in the spec
    assert all(isinstance(x, float) for x in encoded["logprobs"])
    assert all(type(x) is int for x in encoded["input_ids"] + encoded["loss_mask"])


def test_text_mode_sample_has_only_the_four_keys() -> None:
    trajectory = Trajectory("tr_0000000000000001", capture={"mode": "text"})
    request = {"model": "policy", "messages": [{"role": "user", "content": "What is 2+2?"}]}
    call = {"t_start": 1.0, "t_end": 2.0, "sampling": {"temperature": 0.7}}
    commit_text_call(trajectory, CHAT.read(request), {"role": "assistant", "content": "4"}, call)
    [row] = rows_all(trajectory.graph)
    encoded = encode_sample(build_sample(trajectory.graph, row.path, row.targets))
    assert encoded == {
        "leaf": 1,
        "path": [0, 1],
        "messages": [request["messages"][0], {"role": "assistant", "content": "4"}],
        "targets": [1],
    }


def forked_graph() -> Graph:
    """0 user → 1 model → 2 user → 3 model (t_end 3); 1 → 4 user → 5 model (t_end 2)."""
    graph = Graph()
    _add(graph, None, CLIENT, content="q")
    _call(_add(graph, 0, MODEL, content="a"), 1.0)
    _add(graph, 1, CLIENT, content="more")
    _call(_add(graph, 2, MODEL, content="b"), 3.0)
    _add(graph, 1, CLIENT, content="other")
    _call(_add(graph, 4, MODEL, content="c"), 2.0)
    return graph


def test_all_trains_a_shared_model_node_in_its_first_row_only() -> None:
    assert rows_all(forked_graph()) == [Row((0, 1, 2, 3), (1, 3)), Row((0, 1, 4, 5), (5,))]


def test_final_trains_every_model_node_on_the_latest_calls_path() -> None:
    graph = forked_graph()
    _call(graph[5], 9.0)  # a later call reusing node 5 makes it the latest reply
    assert rows_final(graph) == [Row((0, 1, 4, 5), (1, 5))]
    assert rows_final(Graph()) == []


def test_final_path_may_stop_above_a_leaf() -> None:
    graph = forked_graph()
    _call(graph[1], 10.0)
    assert rows_final(graph) == [Row((0, 1), (1,))]


def test_custom_rule_rows_are_validated_and_kept() -> None:
    def best(graph: Graph) -> list[tuple[list[int], list[int]]]:
        return [([0, 1, 4], [np.int64(1)]), ([0, 1, 2, 3], [3])]

    rows = rows_for_finish(forked_graph(), "best", {"best": best})
    assert rows == [Row((0, 1, 4), (1,)), Row((0, 1, 2, 3), (3,))]
    assert samples_field("best", rows) == {
        "paths": "best",
        "rows": [{"leaf": 4, "targets": [1]}, {"leaf": 3, "targets": [3]}],
    }


@pytest.mark.parametrize(
    ("returned", "reason"),
    [
        (7, "TypeError: the rule returned int, not a list of (path, targets) pairs"),
        ([([0, 1],)], "TypeError: row 0 must be a (path, targets) pair, got ([0, 1],)"),
        ([([], [])], "ValueError: row 0 has an empty path"),
        ([([0, 99], [])], "ValueError: row 0 path[1] is node 99, which does not exist (6 nodes)"),
        ([(["0"], [])], "TypeError: row 0 path[0] is '0', not an integer node id"),
        ([([1, 2], [])], "ValueError: row 0 path starts at node 1, which is not a root"),
        ([([0, 1, 4, 3], [])], "ValueError: row 0 path: node 3 is not a child of node 4"),
        ([([0, 1], [3])], "ValueError: row 0 target 3 is not on its path"),
        ([([0, 1], [0])], "ValueError: row 0 target 0 is a client node, not a model node"),
        ([([0, 1], [1, 1])], "ValueError: row 0 lists target 1 twice"),
        (
            [([0, 1], [1]), ([0, 1, 2, 3], [1, 3])],
            "ValueError: node 1 is a target in row 0 and row 1 (a node trains in one row at most)",
        ),
    ],
)
def test_invalid_custom_rows_fail_with_the_rule_name(returned: Any, reason: str) -> None:
    with pytest.raises(PathRuleFailed) as info:
        rows_for_finish(forked_graph(), "mine", {"mine": lambda graph: returned})
    assert str(info.value) == f"path rule 'mine' failed: {reason}"


def test_a_raising_rule_reports_its_exception_type() -> None:
    def broken(graph: Graph) -> list[Any]:
        raise KeyError("no reward")

    with pytest.raises(PathRuleFailed, match=r"^path rule 'x' failed: KeyError: 'no reward'$"):
        rows_for_finish(forked_graph(), "x", {"x": broken})


def test_unknown_rule_names_the_known_ones() -> None:
    with pytest.raises(UnknownPathRule, match=r"^`paths` must be one of \[all, final, best\]$"):
        rows_for_finish(forked_graph(), "nope", {"best": rows_all})


def test_resolve_rule() -> None:
    assert resolve_rule("skycap.samples:rows_all") is rows_all
    with pytest.raises(ValueError, match="must be written 'pkg.module:function'"):
        resolve_rule("skycap.samples")
    with pytest.raises(ValueError, match="cannot import module 'skycap.nowhere'"):
        resolve_rule("skycap.nowhere:f")
    with pytest.raises(ValueError, match="module 'skycap.samples' has no 'nothing'"):
        resolve_rule("skycap.samples:nothing")
    with pytest.raises(ValueError, match="is a str, not a function"):
        resolve_rule("skycap.samples:ALL")


def test_build_rules_and_options() -> None:
    rules = build_rules({"best": "skycap.samples:rows_final", "fn": rows_all})
    assert rules == {"best": rows_final, "fn": rows_all}
    with pytest.raises(ValueError, match="'all' is built in"):
        build_rules({"all": rows_all})
    assert parse_rule_option("best=pkg.mod:fn") == ("best", "pkg.mod:fn")
    assert parse_rule_option("pkg.mod:fn") == ("pkg.mod:fn", "pkg.mod:fn")


def test_recorded_rows_rebuild_paths_from_the_leaf() -> None:
    graph = forked_graph()
    rows = rows_all(graph)
    assert rows_from_samples_field(graph, samples_field("all", rows)) == rows
    with pytest.raises(ValueError, match="recorded samples row 0 leaf is node 9, which does not"):
        rows_from_samples_field(graph, {"paths": "all", "rows": [{"leaf": 9, "targets": []}]})


def _token_chain(*, experts: bool = True, mask: bool = True) -> Graph:
    graph = Graph()
    _add(graph, None, CLIENT, Tokens(ids=[1, 2], experts=_experts([0, 1]) if experts else None))
    ids, offsets = rows_to_csr([[9], [8, 7]])
    model = _add(
        graph,
        0,
        MODEL,
        Tokens(
            ids=[3, 4, 5],
            sampled_start=1,
            logprobs=[float("nan"), -1.0, -2.0],
            experts=_experts([2, 3, 3]),
            mask_ids=ids if mask else None,
            mask_offsets=offsets if mask else None,
        ),
    )
    _call(model, 1.0)
    return graph


def test_missing_experts_or_mask_give_null_and_nan_becomes_zero() -> None:
    sample = build_sample(_token_chain(experts=False, mask=False), [0, 1], [1])
    assert sample.routed_experts is None
    assert sample.sampling_mask is None
    assert sample.logprobs.tolist() == [0.0, 0.0, 0.0, -1.0, -2.0]
    # A row that trains nothing contributes no mask either.
    assert build_sample(_token_chain(), [0, 1], []).sampling_mask is None
    assert build_sample(_token_chain(), [0, 1], []).loss_mask.tolist() == [0] * 5


def test_expert_rows_must_cover_every_token() -> None:
    graph = _token_chain()
    graph[0].tokens.experts = _experts([0])  # one row for two tokens
    assert build_sample(graph, [0, 1], [1]).routed_experts is None


def test_a_node_without_tokens_makes_a_text_only_sample() -> None:
    graph = _token_chain()
    _call(_add(graph, 1, MODEL), 2.0)
    encoded = encode_sample(build_sample(graph, [0, 1, 2], [1, 2]))
    assert list(encoded) == ["leaf", "path", "messages", "targets"]


def test_a_long_path_builds_in_milliseconds() -> None:
    graph = Graph()
    parent = None
    rng = np.random.default_rng(0)
    for k in range(120):
        n = 1000
        if k % 2:
            offsets = np.arange(n - 9, dtype=np.int64)
            tokens = Tokens(
                ids=rng.integers(0, 150_000, n),
                sampled_start=10,
                logprobs=rng.normal(size=n),
                experts=rng.integers(0, 128, (n, 8, 2)).astype(np.uint8),
                mask_ids=np.arange(n - 10, dtype=np.int32),
                mask_offsets=offsets,
            )
        else:
            tokens = Tokens(ids=rng.integers(0, 150_000, n), experts=np.zeros((n, 8, 2), np.uint8))
        node = _add(graph, parent, MODEL if k % 2 else CLIENT, tokens)
        if k % 2:
            _call(node, float(k))
        parent = node.id
    [row] = rows_all(graph)
    started = time.perf_counter()
    sample = build_sample(graph, row.path, row.targets)
    elapsed = time.perf_counter() - started
    assert sample.input_ids.shape == (120_000,)
    assert int(sample.loss_mask.sum()) == 60 * 990
    assert sample.sampling_mask[1].shape == (120_001,)
    assert elapsed < 0.25, f"building a 120k-token sample took {elapsed * 1000:.0f} ms"


# -- reading samples back from a record (skycap.load) ----------------------------------


def _token_trajectory(graph: Graph, trajectory_id: str = "tr_00000000000000aa") -> Trajectory:
    capture = {
        "mode": "tokens",
        "engine": "vllm",
        "tokenizer": "test",
        "logprobs_mode": "processed_logprobs",
        "sampling_overrides": {},
        "use_raw_content": False,
    }
    trajectory = Trajectory(trajectory_id, capture=capture, graph=graph, created_at=0.0)
    trajectory.status, trajectory.ended = "finished", True
    return trajectory


def test_load_returns_the_finish_samples_from_the_sidecars(tmp_path) -> None:
    from skycap.client import Sample
    from skycap.loader import load
    from skycap.record.writer import write_record

    write_record(_token_trajectory(worked_example_graph()), tmp_path)
    record = load(tmp_path, "tr_00000000000000aa")
    assert record.document["id"] == record.trajectory.id == "tr_00000000000000aa"
    [sample] = record.samples()
    expected = Sample.from_json(WORKED_EXAMPLE)
    assert sample.routed_experts.tolist() == expected.routed_experts.tolist()
    sample.routed_experts = expected.routed_experts = None
    assert sample == expected


def test_load_rebuilds_recorded_rows_without_running_the_rule(tmp_path) -> None:
    from skycap.loader import load
    from skycap.record.writer import write_record

    trajectory = _token_trajectory(forked_graph())
    trajectory.samples = samples_field("best", [Row((0, 1, 4), (1,))])
    write_record(trajectory, tmp_path)
    record = load(tmp_path, trajectory.id)
    [best] = record.samples("best")
    assert (best.leaf, best.path, best.targets, best.input_ids) == (4, [0, 1, 4], [1], None)
    assert [(s.leaf, s.targets) for s in record.samples("final")] == [(3, [1, 3])]
    assert [s.leaf for s in record.samples("skycap.samples:rows_all")] == [3, 5]
    with pytest.raises(ValueError, match="recorded with 'best'; ask for that, 'all', 'final'"):
        record.samples("other")

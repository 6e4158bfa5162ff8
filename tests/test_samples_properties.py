"""Property tests of path rules and sample arrays over random graphs and text-mode histories."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skycap.client import Sample
from skycap.dialects.chat import DIALECT as CHAT
from skycap.graph import CLIENT, MODEL, Graph, Tokens
from skycap.samples import (
    Row,
    build_sample,
    encode_sample,
    rows_all,
    rows_final,
    rows_from_samples_field,
    samples_field,
    validate_rows,
)
from skycap.text.commit import commit_text_call
from skycap.trajectory import Trajectory

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORDS = ("a", "b", "c")


# -- token-mode graphs with random payloads ------------------------------------------------


@st.composite
def model_payload(draw: st.DrawFn, length: int) -> dict[str, Any]:
    """A model node's scaffold length, logprobs (NaN allowed) and, maybe, sampling-mask rows."""
    sampled_start = draw(st.integers(0, length))
    sampled = length - sampled_start
    logprobs = draw(
        st.lists(st.floats(-20, 0) | st.just(math.nan), min_size=sampled, max_size=sampled)
    )
    payload: dict[str, Any] = {
        "sampled_start": sampled_start,
        "logprobs": [0.0] * sampled_start + logprobs,
    }
    if draw(st.booleans()):
        row = st.lists(st.integers(0, 99), max_size=3)
        rows = draw(st.lists(row, min_size=sampled, max_size=sampled))
        payload["mask_ids"] = [x for r in rows for x in r]
        payload["mask_offsets"] = np.cumsum([0, *map(len, rows)])
    return payload


@st.composite
def token_graphs(draw: st.DrawFn) -> Graph:
    graph = Graph()
    layers_k = (draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    for i in range(draw(st.integers(0, 14))):
        parent = draw(st.sampled_from([None, *range(i)]))
        model = draw(st.booleans())
        length = draw(st.integers(0, 5))
        ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=length, max_size=length))
        experts = np.full((length, *layers_k), i, dtype=np.uint8) if draw(st.booleans()) else None
        payload = draw(model_payload(length)) if model else {}
        node = graph.add(
            parent,
            author=MODEL if model else CLIENT,
            message={"role": "assistant" if model else "user", "content": str(i)},
            match_hash=f"m{i}",
            delta_hash=f"d{i}",
            created_at=float(i),
            tokens=Tokens(ids=ids, experts=experts, **payload),
        )
        if model:
            for t_end in draw(st.lists(st.floats(0, 100), min_size=1, max_size=2)):
                node.calls.append({"t_start": 0.0, "t_end": t_end, "sampling": {}})
    return graph


def _expected_loss_mask(graph: Graph, row: Row) -> list[int]:
    """1 on the targets' sampled tokens, except where the logprob is missing (NaN)."""
    mask: list[int] = []
    for i in row.path:
        tok = graph[i].tokens
        start = tok.length if i not in row.targets else tok.sampled_start
        sampled = tok.logprobs[start:] if tok.logprobs is not None else [0.0] * (tok.length - start)
        mask += [0] * start + [0 if math.isnan(v) else 1 for v in sampled]
    return mask


@SETTINGS
@given(token_graphs())
def test_all_rows_are_valid_in_leaf_order_and_train_each_model_node_once(graph: Graph) -> None:
    rows = rows_all(graph)
    assert [r.leaf for r in rows] == sorted(n.id for n in graph if not n.children)
    assert validate_rows(graph, [(r.path, r.targets) for r in rows]) == rows
    trained = [t for r in rows for t in r.targets]
    assert sorted(trained) == [n.id for n in graph if n.is_model]
    assert rows_from_samples_field(graph, samples_field("all", rows)) == rows


@SETTINGS
@given(token_graphs())
def test_sample_arrays_follow_the_path(graph: Graph) -> None:
    for row in rows_all(graph):
        sample = build_sample(graph, row.path, row.targets)
        tokens = [graph[i].tokens for i in row.path]
        n = sum(t.length for t in tokens)
        assert sample.input_ids.tolist() == [x for t in tokens for x in t.ids.tolist()]
        assert sample.loss_mask.tolist() == _expected_loss_mask(graph, row)
        assert sample.logprobs.shape == (n,) and np.isfinite(sample.logprobs).all()
        if all(t.experts is not None for t in tokens):
            assert sample.routed_experts.shape[0] == n
            assert sample.routed_experts[:, 0, 0].tolist() == [
                i for i, t in zip(row.path, tokens, strict=True) for _ in range(t.length)
            ]
        else:
            assert sample.routed_experts is None
        target_masks = [graph[t].tokens.mask_row_lists() for t in row.targets]
        if not row.targets or any(m is None for m in target_masks):
            assert sample.sampling_mask is None
        else:
            ids, offsets = sample.sampling_mask
            assert offsets.shape == (n + 1,) and offsets[0] == 0 and offsets[-1] == ids.shape[0]
            expected = []
            for t, rows_of_t in zip(row.targets, target_masks, strict=True):
                tok = graph[t].tokens
                sampled = tok.logprobs[tok.sampled_start :]
                expected += [r for r, lp in zip(rows_of_t, sampled, strict=True) if lp == lp]
            got = [
                ids[offsets[k] : offsets[k + 1]].tolist()
                for k in range(n)
                if sample.loss_mask[k] == 1
            ]
            assert got == expected
            assert all(offsets[k] == offsets[k + 1] for k in range(n) if sample.loss_mask[k] == 0)


@SETTINGS
@given(token_graphs())
def test_wire_round_trip_matches_the_client_sample(graph: Graph) -> None:
    from skycap.loader import to_client_sample

    for row in rows_all(graph):
        built = build_sample(graph, row.path, row.targets)
        decoded = Sample.from_json(encode_sample(built))
        direct = to_client_sample(built)
        assert _plain(decoded) == _plain(direct)


def _plain(sample: Sample) -> dict[str, Any]:
    out = dict(vars(sample))
    experts = out.pop("routed_experts")
    out["routed_experts"] = None if experts is None else (experts.dtype.name, experts.tolist())
    return out


@SETTINGS
@given(token_graphs())
def test_final_picks_the_latest_call(graph: Graph) -> None:
    rows = rows_final(graph)
    calls = [(c["t_end"], n.id) for n in graph for c in n.calls]
    if not calls:
        assert rows == []
        return
    [row] = rows
    assert row.leaf == max(calls)[1]
    assert row.targets == tuple(i for i in row.path if graph[i].is_model)
    assert validate_rows(graph, [(row.path, row.targets)]) == rows


# -- text-mode histories -------------------------------------------------------------------


@st.composite
def text_histories(draw: st.DrawFn) -> tuple[Trajectory, list[int]]:
    """Random conversations with resamples, edited replies, compaction and tool changes.

    Returns the trajectory and, per call, the model node it committed to.
    """
    trajectory = Trajectory("tr_00000000000000ab", capture={"mode": "text"})
    conversations: list[list[dict[str, Any]]] = []
    replies = []
    for k in range(draw(st.integers(1, 8))):
        if conversations and draw(st.booleans()):
            base = draw(st.sampled_from(conversations))
            history = [dict(m) for m in base[: draw(st.integers(0, len(base)))]]
            if history and history[-1]["role"] == "assistant" and draw(st.booleans()):
                history[-1].pop("reasoning_content", None)  # the harness strips reasoning
        else:
            history = [{"role": "system", "content": draw(st.sampled_from(WORDS))}]
        messages = [*history, {"role": "user", "content": draw(st.sampled_from(WORDS))}]
        reply = {"role": "assistant", "content": draw(st.sampled_from(WORDS))}
        if draw(st.booleans()):
            reply["reasoning_content"] = "think"
        request: dict[str, Any] = {"model": "policy", "messages": messages}
        if draw(st.booleans()):
            request["tools"] = [{"type": "function", "function": {"name": "f"}}]
        sampling = {"temperature": draw(st.sampled_from([0.7, 1.0]))}
        call = {"t_start": float(2 * k), "t_end": float(2 * k + 1), "sampling": sampling}
        node = commit_text_call(trajectory, CHAT.read(request), reply, call)
        replies.append(node.id)
        conversations.append([*messages, reply])
    return trajectory, replies


@SETTINGS
@given(text_histories())
def test_text_histories(history: tuple[Trajectory, list[int]]) -> None:
    trajectory, replies = history
    graph = trajectory.graph
    rows = rows_all(graph)
    assert [r.leaf for r in rows] == sorted(graph.leaves())
    trained = sorted(t for r in rows for t in r.targets)
    assert trained == sorted(n.id for n in graph if n.is_model)
    for row in rows:
        encoded = encode_sample(build_sample(graph, row.path, row.targets))
        assert list(encoded) == ["leaf", "path", "messages", "targets"]
        assert encoded["messages"] == [graph[i].message for i in row.path]
    [final] = rows_final(graph)
    assert final.leaf == replies[-1]

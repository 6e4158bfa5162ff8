"""Property test: any token-mode graph written as a record reads back identical (format.md)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skycap.graph import CLIENT, MODEL, Graph, Tokens
from skycap.record.reader import load_trajectory, read_document
from skycap.record.writer import write_record
from skycap.trajectory import STATUSES, Trajectory

TR_ID = "tr_0123456789abcdef"
CAPTURE = {
    "mode": "tokens",
    "engine": "vllm",
    "tokenizer": "Qwen/Qwen3-8B",
    "logprobs_mode": "processed_logprobs",
    "sampling_overrides": {"top_k": 50},
    "use_raw_content": False,
}
token_ids = st.integers(0, 2**31 - 1)
logprob = st.floats(max_value=0.0, allow_nan=False, width=64)
timestamps = st.floats(1.7e9, 1.8e9)


@st.composite
def text_of(draw: st.DrawFn, length: int) -> tuple[bytes, np.ndarray] | tuple[None, None]:
    """Some UTF-8 text (multibyte and astral characters too) and valid per-token offsets."""
    if not draw(st.booleans()):
        return None, None
    text = draw(st.text(max_size=6)).encode()
    offsets = sorted(draw(st.lists(st.integers(0, len(text)), min_size=length, max_size=length)))
    return text, np.array(offsets, dtype=np.int32)


@st.composite
def node_tokens(
    draw: st.DrawFn, model: bool, experts: tuple[int, int, Any] | None, masks: bool
) -> Tokens:
    length = draw(st.integers(0, 5))
    ids = draw(st.lists(token_ids, min_size=length, max_size=length))
    sampled_start = draw(st.integers(0, length)) if model else None
    logprobs = None
    if model and draw(st.booleans()):
        sampled = draw(st.lists(logprob, min_size=length - sampled_start, max_size=length))
        logprobs = [0.0] * sampled_start + sampled[: length - sampled_start]
    rows = None
    if experts is not None and draw(st.booleans()):
        layers, k, dtype = experts
        size = length * layers * k * np.dtype(dtype).itemsize
        raw = draw(st.binary(min_size=size, max_size=size))
        rows = np.frombuffer(raw, dtype=dtype).reshape(length, layers, k).copy()
    mask_rows = None
    if model and masks:
        mask_rows = draw(
            st.lists(
                st.lists(token_ids, max_size=3),
                min_size=length - sampled_start,
                max_size=length - sampled_start,
            )
        )
    text, text_offsets = draw(text_of(length))
    media = [] if model else draw(st.sampled_from([[], [{"modality": "image", "offset": 0}]]))
    mask_ids = [i for row in mask_rows for i in row] if mask_rows is not None else None
    return Tokens(
        ids=ids,
        sampled_start=sampled_start,
        logprobs=logprobs,
        experts=rows,
        mask_ids=mask_ids,
        mask_offsets=None if mask_rows is None else np.cumsum([0] + [len(r) for r in mask_rows]),
        media=media,
        text=text,
        text_offsets=text_offsets,
    )


def call(draw: st.DrawFn) -> dict[str, Any]:
    entry = {
        "t_start": draw(timestamps),
        "t_end": draw(timestamps),
        "model": "policy",
        "sampling": {"temperature": draw(st.sampled_from([0.7, 1.0, 1e-06]))},
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        "finish_reason": "stop",
        "tools": None,
        "bridged": draw(st.sampled_from([None, True, False])),
    }
    if draw(st.booleans()):
        del entry["bridged"]  # an older record's call
    return entry


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    experts = draw(
        st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 2), st.just(np.uint8)))
    )
    if experts is not None and draw(st.booleans()):
        experts = (*experts[:2], np.uint16)
    masks = draw(st.booleans())
    graph = Graph()
    for index in range(draw(st.integers(0, 7))):
        model = draw(st.booleans())
        node = graph.add(
            draw(st.sampled_from([None, *range(index)])),
            author=MODEL if model else CLIENT,
            message={"role": "assistant" if model else "user", "content": draw(st.text())},
            match_hash=draw(st.sampled_from(["a" * 32, "b" * 32])),
            delta_hash=f"{index:032x}",
            created_at=draw(timestamps),
            tokens=draw(node_tokens(model, experts, masks)),
        )
        if model:
            node.calls.extend(call(draw) for _ in range(draw(st.integers(1, 2))))
    trajectory = Trajectory(
        TR_ID, capture=CAPTURE, meta={"task": draw(st.text())}, created_at=1.7e9, graph=graph
    )
    trajectory.status = draw(st.sampled_from(STATUSES))
    trajectory.ended = draw(st.booleans())
    trajectory.finished_at = draw(st.one_of(st.none(), timestamps))
    trajectory.annotations = {"reward": draw(st.floats(allow_nan=False, allow_infinity=False))}
    trajectory.retries = {"replayed": draw(st.integers(0, 3)), "coalesced": 0}
    trajectory.samples = draw(st.sampled_from([None, {"paths": "all", "rows": []}]))
    return trajectory


def same_array(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def assert_same_tokens(original: Tokens | None, loaded: Tokens | None, experts_dtype) -> None:
    assert (original is None) == (loaded is None)
    if original is None:
        return
    assert same_array(original.ids, loaded.ids)
    assert original.sampled_start == loaded.sampled_start
    assert same_array(original.logprobs, loaded.logprobs)
    expected_experts = None if original.experts is None else original.experts.astype(experts_dtype)
    assert same_array(expected_experts, loaded.experts)
    assert original.mask_row_lists() == loaded.mask_row_lists()
    assert original.text == loaded.text
    offsets = original.text_offsets
    assert same_array(None if offsets is None else offsets.astype(np.int32), loaded.text_offsets)
    assert original.media == loaded.media


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories())
def test_written_records_read_back_identical(trajectory: Trajectory) -> None:
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        files = write_record(trajectory, Path(first))
        loaded = load_trajectory(Path(first), TR_ID)

        assert loaded.document() == trajectory.document()
        experts = [n.tokens.experts for n in trajectory.graph if n.tokens.experts is not None]
        dtype = experts[0].dtype if experts else None
        for original, back in zip(trajectory.graph, loaded.graph, strict=True):
            assert (original.id, original.calls) == (back.id, back.calls)
            assert_same_tokens(original.tokens, back.tokens, dtype)

        assert write_record(loaded, Path(second)) == files
        for name in files:
            assert (Path(first) / name).read_bytes() == (Path(second) / name).read_bytes()
        document = read_document(Path(second) / files[-1])
        assert [n["tokens"] is not None for n in document["nodes"]] == [True] * len(
            trajectory.graph
        )

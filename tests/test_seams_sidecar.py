"""A new sidecar kind is one registry entry: a toy kind written, read, validated, journalled,
replayed and sliced into samples with no other code changed (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import zstandard

from skycap.arrays import unpack
from skycap.graph import CLIENT, MODEL, Tokens
from skycap.hashing import token_match
from skycap.record.journal import Journal, read_journal, replay_journals
from skycap.record.reader import load_trajectory, read_document, read_sidecar
from skycap.record.sidecars import KINDS, RowsKind, kind_order, register, unregister
from skycap.record.writer import write_record
from skycap.samples import build_samples, encode_sample, rows_all
from skycap.tokens.commit import CommitError, commit_turn
from skycap.tokens.engine import EngineOutput
from skycap.tokens.plan import NewMessage, Plan
from skycap.trajectory import Trajectory
from skycap.viewer.validate import check_document

TR = "tr_000000000000a0b1"
# A per-token score of the model's tokens, kept in Tokens.extra (no field of its own).
TOY = RowsKind(
    "toy",
    array="scores",
    field="scores",
    offset_key="scores_offset",
    rows_key="scores_rows",
    sample_key="scores",
    own=False,
)


@pytest.fixture
def toy() -> Iterator[RowsKind]:
    register(TOY)
    try:
        yield TOY
    finally:
        unregister(TOY.name)


def _trajectory() -> Trajectory:
    """user (3 tokens) → model (4 tokens, 2 sampled, scored) → user (2) → model (3, scored)."""
    trajectory = Trajectory(TR, capture={"mode": "tokens"})
    graph = trajectory.graph
    parent = None
    for n, (author, length) in enumerate([(CLIENT, 3), (MODEL, 4), (CLIENT, 2), (MODEL, 3)]):
        model = author == MODEL
        tokens = Tokens(
            ids=np.arange(length) + 10 * n,
            sampled_start=2 if model else None,
            logprobs=np.r_[0.0, 0.0, np.linspace(-1, 0, length - 2)] if model else None,
            extra={"scores": np.arange(length, dtype=np.float64) + n / 10} if model else None,
        )
        node = graph.add(
            parent,
            author=author,
            message={"role": "assistant" if model else "user", "content": str(n)},
            match_hash=f"{n:032x}",
            delta_hash=f"{n:032x}",
            created_at=float(n),
            tokens=tokens,
        )
        if model:
            node.calls.append({"t_start": float(n), "t_end": float(n) + 0.5})
        parent = node.id
    return trajectory


def _scores(trajectory: Trajectory) -> list:
    return [
        None if n.tokens is None or n.tokens.extra is None else n.tokens.extra["scores"].tolist()
        for n in trajectory.graph
    ]


def test_a_registered_kind_is_written_read_validated_and_sliced(
    toy: RowsKind, tmp_path: Path
) -> None:
    trajectory = _trajectory()
    written = write_record(trajectory, tmp_path)
    assert written == [
        f"{TR}.tokens.zst",
        f"{TR}.toy.zst",
        f"{TR}.json.zst",
    ]  # kind order: the new kind after the built-in ones
    assert KINDS[-1] == "toy" and kind_order("toy") < kind_order("zzz")

    document = read_document(tmp_path / f"{TR}.json.zst")
    assert document["sidecars"]["toy"]["arrays"]["scores"]["shape"] == [7]
    keys = list(document["nodes"][3]["tokens"])
    assert keys[-3:] == ["scores_offset", "scores_rows", "media"]
    assert document["nodes"][3]["tokens"]["scores_offset"] == 4
    assert document["nodes"][0]["tokens"]["scores_offset"] is None
    arrays = read_sidecar(tmp_path, document, "toy")
    assert arrays is not None and arrays["scores"].tolist() == [0.1, 1.1, 2.1, 3.1, 0.3, 1.3, 2.3]

    back = load_trajectory(tmp_path, TR)
    assert _scores(back) == _scores(trajectory)
    assert back.graph[1].tokens.experts is None  # the other kinds read as before

    assert check_document(tmp_path, TR, sidecars=True) == ([], [])

    # A path whose every node has scores slices them; here the client nodes have none.
    assert all("scores" not in s.extra for s in build_samples(back.graph, rows_all(back.graph)))
    for node in back.graph:
        node.tokens.extra = {"scores": np.full(node.tokens.length, float(node.id))}
    (sample,) = build_samples(back.graph, rows_all(back.graph))
    assert sample.extra["scores"].tolist() == [0.0] * 3 + [1.0] * 4 + [2.0] * 2 + [3.0] * 3
    wire = encode_sample(sample)
    assert list(wire)[-2:] == ["scores", "media"]
    assert unpack(wire["scores"]).tolist() == sample.extra["scores"].tolist()


def test_the_validator_checks_a_kinds_rows_and_forgets_it_once_unregistered(
    toy: RowsKind, tmp_path: Path
) -> None:
    write_record(_trajectory(), tmp_path)
    path = tmp_path / f"{TR}.json.zst"
    document = orjson.loads(zstandard.ZstdDecompressor().decompress(path.read_bytes()))
    document["nodes"][3]["tokens"]["scores_rows"] = 9
    path.write_bytes(zstandard.ZstdCompressor().compress(orjson.dumps(document)))
    problems, _ = check_document(tmp_path, TR, sidecars=True)
    assert problems == ["node 3 toy [4, 13) outside the 7-row sidecar"]

    unregister(toy.name)
    try:
        problems, _ = check_document(tmp_path, TR, sidecars=True)
        assert 'unknown sidecar kind "toy"' in problems
    finally:
        register(toy)


def test_a_kinds_arrays_survive_the_journal_and_its_replay(toy: RowsKind, tmp_path: Path) -> None:
    trajectory = _trajectory()
    journal = Journal(tmp_path)
    journal.open(trajectory)
    journal.append(trajectory, 2)
    journal.close()
    assert _scores(read_journal(tmp_path, TR)) == _scores(trajectory)

    replayed = replay_journals(tmp_path)
    assert replayed.written == [TR]
    assert _scores(load_trajectory(tmp_path, TR)) == _scores(trajectory)


def test_token_mode_collects_a_kinds_rows_from_the_engine_output(
    toy: RowsKind, tmp_path: Path
) -> None:
    """The engine wire fills `EngineOutput.extra`; the commit pads the scaffold with zeros."""
    user = {"role": "user", "content": "hi"}
    plan = Plan(
        prompt_ids=[1, 2, 3, 4],
        parent=None,
        new=[NewMessage(user, token_match(user, "", "policy"), np.asarray([1, 2, 3], np.int32))],
        scaffold=np.asarray([4], np.int32),
        bridged=None,
        reused=0,
        routes_from=0,
    )
    call = {"t_start": 1.0, "t_end": 2.0, "model": "policy", "sampling": {}}
    reply = {"role": "assistant", "content": "ok"}

    def output(scores: list[float]) -> EngineOutput:
        return EngineOutput(
            completion_ids=[5, 6],
            logprobs=[-0.5, -0.25],
            finish_reason="stop",
            extra={"scores": np.asarray(scores)},
        )

    trajectory = Trajectory(TR, capture={"mode": "tokens"})
    with pytest.raises(CommitError, match=r"scores has shape \(3,\) for 2 completion tokens"):
        commit_turn(trajectory, plan, output([1, 2, 3]), reply, dict(call), tools=None, model="p")
    assert len(trajectory.graph) == 0
    node = commit_turn(
        trajectory, plan, output([0.5, 0.75]), reply, dict(call), tools=None, model="p"
    )
    assert node is not None and node.tokens.extra["scores"].tolist() == [0.0, 0.5, 0.75]
    assert trajectory.graph[0].tokens.extra is None

    write_record(trajectory, tmp_path)
    assert _scores(load_trajectory(tmp_path, TR)) == [None, [0.0, 0.5, 0.75]]

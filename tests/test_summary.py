"""Tests of `skycap summary`: every figure of docs/tools.md "skycap summary" on a small record
directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import zstandard

from skycap.cli.main import main
from skycap.cli.summary import reward_stats
from skycap.dialects.chat import DIALECT as CHAT
from skycap.graph import CLIENT, MODEL, Tokens
from skycap.hashing import token_client_delta, token_match, token_model_delta
from skycap.record.writer import write_record
from skycap.text.commit import commit_text_call
from skycap.trajectory import Trajectory

Q = {"role": "user", "content": "q"}
A1 = {"role": "assistant", "content": "4"}
TOKEN_CAPTURE = {
    "mode": "tokens",
    "engine": "vllm",
    "tokenizer": "test",
    "logprobs_mode": "processed_logprobs",
    "sampling_overrides": {},
    "use_raw_content": False,
}


def _text(trajectory_id: str, *replies: str) -> Trajectory:
    trajectory = Trajectory(trajectory_id, capture={"mode": "text"}, created_at=0.0)
    for k, reply in enumerate(replies):
        call = {"t_start": float(k), "t_end": k + 0.5, "sampling": {}}
        request = {"model": "policy", "messages": [Q]}
        commit_text_call(
            trajectory, CHAT.read(request), {"role": "assistant", "content": reply}, call
        )
    return trajectory


def _add(trajectory: Trajectory, parent, author, message, ids, bridged: Any = None) -> int:
    match = token_match(message, "", "policy")
    model = author == MODEL
    delta = token_model_delta(match, {}, 1, ids) if model else token_client_delta(match, ids)
    tokens = Tokens(ids=ids, sampled_start=1 if model else None)
    node = trajectory.graph.add(
        parent,
        author=author,
        message=message,
        match_hash=match,
        delta_hash=delta,
        created_at=1.0,
        tokens=tokens,
    )
    if model:
        node.calls.append({"t_start": 0.0, "t_end": 1.0, "sampling": {}, "bridged": bridged})
    return node.id


def _retokenized(trajectory_id: str) -> Trajectory:
    """A reply sent back and re-rendered to other tokens: a client copy shadowed by the reply."""
    trajectory = Trajectory(trajectory_id, capture=TOKEN_CAPTURE, created_at=0.0)
    root = _add(trajectory, None, CLIENT, Q, [1, 2])
    _add(trajectory, root, MODEL, A1, [3, 4])
    copy = _add(trajectory, root, CLIENT, A1, [3, 5])
    more = _add(trajectory, copy, CLIENT, {"role": "user", "content": "more"}, [6])
    _add(trajectory, more, MODEL, {"role": "assistant", "content": "ok"}, [3, 7], bridged=False)
    return trajectory


def _write(trajectory: Trajectory, record_dir: Path, *, end: bool = True, **annotations) -> None:
    if end:
        trajectory.seal("finished")
        trajectory.ended = True
    trajectory.annotations = annotations
    write_record(trajectory, record_dir)


@pytest.fixture
def record_dir(tmp_path: Path) -> Path:
    _write(_text("tr_1", "4"), tmp_path, reward=1.0)
    forked = _text("tr_2", "4", "5")
    forked.add_failure(500, "upstream: boom")
    forked.retries["replayed"] = 1
    _write(forked, tmp_path, reward=0)
    _write(_retokenized("tr_3"), tmp_path, reward="n/a")
    still_open = _text("tr_4", "4")
    del still_open.graph[1].calls[0]["bridged"]  # as written before the field existed
    _write(still_open, tmp_path, end=False)
    _write(_text("tr_5"), tmp_path)
    (tmp_path / "tr_bad.json.zst").write_bytes(zstandard.ZstdCompressor().compress(b"[]"))
    return tmp_path


EXPECTED_STATS = {
    "trajectories": 5,
    "unreadable": 1,
    "status": {"finished": 4, "open": 1},
    "not_ended": 1,
    "modes": {"text": 4, "tokens": 1},
    "empty": 1,
    "nodes": 12,
    "calls": 6,
    "tokens": 9,
    "paths": {"total": 6, "histogram": {"0": 1, "1": 2, "2": 2}, "max": {"paths": 2, "id": "tr_2"}},
    "forked": 2,
    "branch_points": 2,
    "bridged": {"true": 0, "false": 1, "null": 4, "absent": 1},
    "with_unbridged": 1,
    "with_bridged_absent": 1,
    "shadowed_nodes": 1,
    "retokenized_copies": 1,
    "with_retokenized": 1,
    "inferred_unbridged": 1,
    "with_inferred_unbridged": 1,
    "failures": 1,
    "with_failures": 1,
    "retries": {"replayed": 1, "coalesced": 0},
    "sidecars": {"tokens": 1},
    "reward": {
        "count": 2,
        "missing": 3,
        "mean": 0.5,
        "min": 0,
        "p50": 1.0,
        "max": 1.0,
        "values": {"0": 1, "1": 1},
    },
}


def test_json_figures(record_dir: Path, capsys) -> None:
    assert main(["summary", str(record_dir), "--json"]) == 0
    out = capsys.readouterr().out
    assert out.startswith('[\n {\n  "dir": ')  # indent 1
    [result] = json.loads(out)
    assert result == {
        "dir": str(record_dir),
        "stats": EXPECTED_STATS,
        "errors": [{"id": "tr_bad", "error": "the document is a JSON list, not an object"}],
    }


def test_tables_show_every_figure(record_dir: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    assert main(["summary", str(record_dir)]) == 0
    out = capsys.readouterr().out
    for figure in [
        "5  (+1 unreadable)",
        "finished=4 open=1  (not ended: 1)",
        "text=4 tokens=1",
        "tokens=1",
        "12 / 6 / 9",
        "1 (20.0%)",
        "0:1 1:2 2:2  (total 6, max 2 in tr_2)",
        "2 (40.0%), 2 branch points",
        "true=0 false=1 null=4 absent=1",
        "1 trajectories (written before the field existed: unknown)",
        "1 re-tokenized copies of a model node (in 1); 1 model calls inferred unbridged (in 1)",
        "1 in 1 trajectories",
        "replayed=1 coalesced=0",
        "n=2 (missing 3) mean=0.5000 min=0 p50=1 max=1",
        "0: 1  1: 1",
        "tr_bad: the document is a JSON list, not an object",
    ]:
        assert figure in out, figure
    assert " ms)" in out


def test_reward_buckets_when_values_are_many() -> None:
    stats = reward_stats([float(v) for v in range(13)], 14)
    assert (stats["count"], stats["missing"], stats["p50"], stats["mean"]) == (13, 1, 6.0, 6.0)
    assert "values" not in stats
    assert [b["n"] for b in stats["histogram"]] == [2, 1, 1, 1, 1, 2, 1, 1, 1, 2]
    assert stats["histogram"][-1]["to"] == pytest.approx(12.0)


def test_several_directories_and_usage_errors(record_dir: Path, tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    # An empty folder is no record directory: said so, not summarised as zeros.
    assert main(["summary", str(record_dir), str(empty), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"error: no records in {empty}: no *.json.zst" in captured.err
    # A folder of record directories (one per run) is summarised run by run.
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        (runs / name).mkdir(parents=True)
        for document in sorted(record_dir.glob("*.json.zst"))[: 2 if name == "a" else 3]:
            (runs / name / document.name).write_bytes(document.read_bytes())
    assert main(["summary", str(runs), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [(Path(r["dir"]).name, r["stats"]["trajectories"]) for r in results] == [
        ("a", 2),
        ("b", 3),
    ]

    assert main(["summary", str(tmp_path / "nope")]) == 2
    assert (
        capsys.readouterr().err.rstrip().endswith(f"error: {tmp_path / 'nope'} is not a directory")
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["summary"])
    assert exit_info.value.code == 2

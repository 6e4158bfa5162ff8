"""Tests of `skycap check` on records written by the record writer (graph.md §6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import zstandard

from skycap.cli.main import main
from skycap.dialects.chat import DIALECT as CHAT
from skycap.graph import CLIENT, MODEL, Tokens
from skycap.hashing import token_client_delta, token_match, token_model_delta
from skycap.linearity import analyse, article, changes
from skycap.record.writer import write_record
from skycap.text.commit import commit_text_call
from skycap.trajectory import Trajectory

Q = {"role": "user", "content": "q"}
MORE = {"role": "user", "content": "more"}
TOOLS = [{"type": "function", "function": {"name": "f"}}]
TOKEN_CAPTURE = {
    "mode": "tokens",
    "engine": "vllm",
    "tokenizer": "test",
    "logprobs_mode": "processed_logprobs",
    "sampling_overrides": {},
    "use_raw_content": False,
}


class Text:
    """A text-mode trajectory fed with calls, as the server would commit them."""

    def __init__(self, trajectory_id: str) -> None:
        self.trajectory = Trajectory(trajectory_id, capture={"mode": "text"}, created_at=0.0)
        self.clock = 0.0

    def call(
        self, messages: list[dict[str, Any]], reply: Any, *, temperature: float = 0.7, tools=None
    ) -> Text:
        request: dict[str, Any] = {"model": "policy", "messages": messages}
        if tools:
            request["tools"] = tools
        if isinstance(reply, str):
            reply = {"role": "assistant", "content": reply}
        self.clock += 2
        call = {
            "t_start": self.clock - 1,
            "t_end": self.clock,
            "sampling": {"temperature": temperature},
        }
        commit_text_call(self.trajectory, CHAT.read(request), reply, call)
        return self

    def write(self, record_dir: Path) -> None:
        _finish_and_write(self.trajectory, record_dir)


def _finish_and_write(trajectory: Trajectory, record_dir: Path) -> None:
    trajectory.seal("finished")
    trajectory.ended = True
    write_record(trajectory, record_dir)


class Tok:
    """A token-mode graph built node by node, with real token hashes."""

    def __init__(self, trajectory_id: str) -> None:
        self.trajectory = Trajectory(trajectory_id, capture=TOKEN_CAPTURE, created_at=0.0)

    def client(self, parent: int | None, message: dict[str, Any], ids: list[int]) -> int:
        match = token_match(message, "", "policy")
        return self.trajectory.graph.add(
            parent,
            author=CLIENT,
            message=message,
            match_hash=match,
            delta_hash=token_client_delta(match, ids),
            created_at=1.0,
            tokens=Tokens(ids=ids),
        ).id

    def model(self, parent: int, message: dict[str, Any], ids: list[int], bridged: Any) -> int:
        match = token_match(message, "", "policy")
        node = self.trajectory.graph.add(
            parent,
            author=MODEL,
            message=message,
            match_hash=match,
            delta_hash=token_model_delta(match, {}, 1, ids),
            created_at=2.0,
            tokens=Tokens(ids=ids, sampled_start=1, logprobs=[0.0] + [-0.5] * (len(ids) - 1)),
        )
        node.calls.append(
            {
                "t_start": 1.0,
                "t_end": 2.0,
                "model": "policy",
                "sampling": {},
                "usage": None,
                "finish_reason": "stop",
                "tools": None,
                "bridged": bridged,
            }
        )
        return node.id

    def write(self, record_dir: Path) -> None:
        _finish_and_write(self.trajectory, record_dir)


def check(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(["check", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def _zst(path: Path, data: bytes) -> None:
    path.write_bytes(zstandard.ZstdCompressor().compress(data))


# -- the example of graph.md §6 ---------------------------------------------------------


def test_the_spec_example(tmp_path: Path, capsys) -> None:
    Text("tr_a").call([Q], "4").write(tmp_path)
    b = Tok("tr_b")
    b.client(None, Q, [1, 2])
    b.model(0, {"role": "assistant", "content": "4", "reasoning_content": "hm"}, [3, 4, 5], None)
    edited = b.client(0, {"role": "assistant", "content": "4"}, [3, 5])
    b.model(b.client(edited, MORE, [6]), {"role": "assistant", "content": "ok"}, [3, 7], False)
    b.write(tmp_path)
    Text("tr_c").write(tmp_path)
    Text("tr_bad").call([Q], "4").write(tmp_path)
    bad = tmp_path / "tr_bad.json.zst"
    bad.write_bytes(bad.read_bytes()[:-5])

    code, lines, err = check(capsys, tmp_path)
    assert lines[:6] == [
        "tr_a  finished  linear",
        "tr_b  finished  2 paths",
        "  node 2 (under node 0, vs node 1): edited reply: the harness sent back the model's "
        "reply with reasoning_content dropped",
        "  1 unbridged call(s): prompt re-rendered, not extended",
        "tr_bad  unreadable: " + lines[4].split("unreadable: ", 1)[1],
        "tr_c  finished  empty: no model call captured",
    ]
    assert "truncated zstd frame" in lines[4]
    assert lines[6:] == ["2 of 3 trajectories linear; forks: 1 edited reply; 1 empty; 1 unreadable"]
    assert (code, err) == (2, "")


# -- one scenario per cause ----------------------------------------------------------------

A1 = {"role": "assistant", "content": "4"}

SCENARIOS = {
    "linear": (lambda: Text("tr_x").call([Q], "4").call([Q, A1, MORE], "5"), []),
    "resample, model S": (
        lambda: Text("tr_x").call([Q], "4").call([Q], "4", temperature=1.0),
        [
            "node 2 (under node 0, vs node 1): resample: the same reply again, under other "
            "sampling parameters or tokenized differently"
        ],
    ),
    "resample, client S": (
        lambda: Text("tr_x").call([Q, A1, MORE], "x").call([Q], "4"),
        [
            "node 4 (under node 0, vs node 1): resample: the model sampled a message the "
            "harness had already written"
        ],
    ),
    "second reply": (
        lambda: Text("tr_x").call([Q], "4").call([Q], "5"),
        ["node 2 (under node 0, vs node 1): resample: a second reply to the same history"],
    ),
    "reply to a shorter history": (
        lambda: Text("tr_x").call([Q], "4").call([Q, A1, MORE], "5").call([Q, A1], "6"),
        [
            "node 4 (under node 1, vs node 2): resample: a reply to a history the other path "
            "continues with a user message"
        ],
    ),
    "edited reply": (
        lambda: (
            Text("tr_x")
            .call([Q], {"role": "assistant", "content": "4", "reasoning_content": "r"})
            .call([Q, A1, MORE], "5")
        ),
        [
            "node 2 (under node 0, vs node 1): edited reply: the harness sent back the model's "
            "reply with reasoning_content dropped"
        ],
    ),
    "compaction": (
        lambda: (
            Text("tr_x")
            .call([{"role": "system", "content": "s"}, Q], "4")
            .call([{"role": "system", "content": "s"}, Q, A1, MORE], "5")
            .call([{"role": "system", "content": "s"}, {"role": "user", "content": "sum"}], "6")
        ),
        [
            "node 5 (under node 0, vs node 1): compaction: a user message in place of the 4 "
            "messages from node 1 to node 4, as a summary replaces the history"
        ],
    ),
    "other role": (
        lambda: (
            Text("tr_x")
            .call([{"role": "system", "content": "s"}, Q], "4")
            .call([{"role": "system", "content": "s"}, {"content": "x"}], "4")
        ),
        [
            "node 3 (under node 0, vs node 1): different message: an unnamed message where the "
            "other path has a user message",
        ],
    ),
    "tools changed": (
        lambda: Text("tr_x").call([Q], "4").call([Q], "4", tools=TOOLS),
        [
            "node 2 (new root, vs node 0): tools or model: the same message, sent with a "
            "different tool set or model"
        ],
    ),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(name: str, tmp_path: Path, capsys) -> None:
    build, forks = SCENARIOS[name]
    build().write(tmp_path)
    code, lines, _ = check(capsys, tmp_path)
    assert lines[1:-1] == [f"  {line}" for line in forks]
    assert lines[0] == f"tr_x  finished  {'linear' if not forks else '2 paths'}"
    assert code == (1 if forks else 0)


def test_re_rendered_client_node_in_token_mode(tmp_path: Path, capsys) -> None:
    t = Tok("tr_r")
    t.model(t.client(None, Q, [1, 2]), {"role": "assistant", "content": "4"}, [3, 4], None)
    t.model(
        t.client(None, {**Q, "x-extra": 1}, [1, 9]),
        {"role": "assistant", "content": "4"},
        [3, 4],
        False,
    )
    t.write(tmp_path)
    code, lines, _ = check(capsys, tmp_path)
    assert lines == [
        "tr_r  finished  2 paths",
        "  node 2 (new root, vs node 0): re-rendered: the same message, rendered to different "
        "tokens",
        "  1 unbridged call(s): prompt re-rendered, not extended",
        "0 of 1 trajectories linear; forks: 1 re-rendered",
    ]
    assert code == 1


def test_summary_orders_causes_by_count(tmp_path: Path, capsys) -> None:
    Text("tr_1").call([Q], "4").call([Q], "5").call([Q], "6").write(tmp_path)
    Text("tr_2").call([Q], "4").call([Q], "4", tools=TOOLS).write(tmp_path)
    Text("tr_3").call([Q], "4").write(tmp_path)
    code, lines, _ = check(capsys, tmp_path)
    assert lines[-1] == "1 of 3 trajectories linear; forks: 2 resample, 1 tools or model"
    assert code == 1


# -- unreadable records and usage errors ---------------------------------------------------


def test_unreadable_records(tmp_path: Path, capsys) -> None:
    Text("tr_ok").call([Q], "4").write(tmp_path)
    _zst(tmp_path / "tr_list.json.zst", b"[]")
    _zst(tmp_path / "tr_v99.json.zst", b'{"format_version": 99, "id": "tr_v99"}')
    _zst(
        tmp_path / "tr_loop.json.zst",
        b'{"format_version": 1, "id": "tr_loop", "status": "finished", "sidecars": {},'
        b' "nodes": [{"id": 0, "parent": 3, "author": "client", "message": {}}]}',
    )
    code, lines, err = check(capsys, tmp_path)
    assert lines == [
        "tr_list  unreadable: the document is a JSON list, not an object",
        "tr_loop  unreadable: node 0 has parent 3, not an earlier node",
        "tr_ok  finished  linear",
        "tr_v99  unreadable: format_version 99, this skycap reads 1",
        "1 of 1 trajectories linear; 3 unreadable",
    ]
    assert (code, err) == (2, "")


def test_ids_are_checked_once_in_the_order_given(tmp_path: Path, capsys) -> None:
    Text("tr_1").call([Q], "4").write(tmp_path)
    Text("tr_2").call([Q], "4").call([Q], "5").write(tmp_path)
    code, lines, _ = check(capsys, tmp_path, "tr_2", "tr_1", "tr_2")
    assert [line.split("  ")[0] for line in lines if line.startswith("tr_")] == ["tr_2", "tr_1"]
    assert lines[-1] == "1 of 2 trajectories linear; forks: 1 resample"
    assert code == 1
    assert check(capsys, tmp_path, "tr_1")[0] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing"], "{d}/missing is not a directory"),
        (["empty"], "no trajectories in {d}/empty"),
        (
            ["full", "tr_1", "tr_9", "../full/tr_1", "tr_1"],
            "no trajectory tr_9, ../full/tr_1 in {d}/full",
        ),
    ],
)
def test_usage_errors(args: list[str], message: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    Text("tr_1").call([Q], "4").write(tmp_path / "full")
    code, lines, err = check(capsys, f"{tmp_path}/{args[0]}", *args[1:])
    assert (code, lines) == (2, [])
    assert err.startswith("usage: skycap check")
    assert err.rstrip("\n").endswith(f"skycap check: error: {message.format(d=tmp_path)}")


def test_articles_and_changes() -> None:
    assert [article(w) for w in ("assistant", "user", "unnamed", "tool", "ok", "Expert")] == [
        "an",
        "a",
        "an",
        "a",
        "an",
        "an",
    ]
    before = {"a": 1, "b": 1.0, "c": [1]}
    assert changes(before, {"a": 1, "b": 1, "d": 2}) == ["b changed", "c dropped", "d added"]


def test_analyse_reads_the_document_only() -> None:
    document = {
        "id": "tr_x",
        "status": "open",
        "capture": {"mode": "text"},
        "nodes": [
            {
                "id": 0,
                "parent": None,
                "role": "user",
                "author": "client",
                "message": Q,
                "match_hash": "a",
                "calls": [],
            },
        ],
    }
    report = analyse(document)
    assert (report.shape, report.linear, report.forks, report.lines()) == (
        "linear",
        True,
        [],
        ["tr_x  open  linear"],
    )


def test_json_and_forks_only(tmp_path: Path, capsys) -> None:
    import json

    Text("tr_1").call([Q], "4").call([Q], "5").call([Q], "6").write(tmp_path)
    Text("tr_2").call([Q], "4").write(tmp_path)
    _zst(tmp_path / "tr_bad.json.zst", b"[]")
    code, lines, _ = check(capsys, tmp_path, "--json")
    objects = [json.loads(line) for line in lines]
    assert code == 2 and [o["id"] for o in objects] == ["tr_1", "tr_2", "tr_bad"]
    assert objects[0]["paths"] == 3 and objects[0]["causes"] == {"resample": 2}
    assert objects[0]["status"] == "finished" and objects[0]["linear"] is False
    assert [f["cause"] for f in objects[0]["forks"]] == ["resample", "resample"]
    assert objects[1] == {
        "id": "tr_2",
        "status": "finished",
        "paths": 1,
        "linear": True,
        "causes": {},
        "forks": [],
        "unbridged_calls": 0,
    }
    assert objects[2] == {"id": "tr_bad", "error": "the document is a JSON list, not an object"}
    code, lines, _ = check(capsys, tmp_path, "--forks-only")
    assert [line.split("  ")[0] for line in lines if line.startswith("tr_")] == ["tr_1", "tr_bad"]
    assert lines[-1] == "1 of 2 trajectories linear; forks: 2 resample; 1 unreadable"
    code, lines, _ = check(capsys, tmp_path, "--forks-only", "--json")
    assert [json.loads(line)["id"] for line in lines] == ["tr_1", "tr_bad"]


def test_a_large_directory_says_its_summary_first(tmp_path: Path, capsys) -> None:
    for i in range(20):
        Text(f"tr_{i:02d}").call([Q], "4").write(tmp_path)
    code, lines, _ = check(capsys, tmp_path)
    assert code == 0 and lines[0] == lines[-1] == "20 of 20 trajectories linear"
    assert len(lines) == 22

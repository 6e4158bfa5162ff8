"""The crash journal: token-mode calls come back exactly, torn tails dropped, live journals kept."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from server_fixtures import Control, ServerThread

from skycap.graph import CLIENT, MODEL, Graph, Tokens
from skycap.record.journal import (
    RECOVERED,
    Journal,
    journal_paths,
    pending_journals,
    read_journal,
    replay_journals,
)
from skycap.record.reader import load_trajectory
from skycap.record.writer import write_record
from skycap.server.options import ServerOptions
from skycap.trajectory import Trajectory

TR = "tr_00000000000000cc"


def _arrays(tokens: Tokens | None) -> Any:
    if tokens is None:
        return None
    names = ("ids", "logprobs", "experts", "mask_ids", "mask_offsets")
    return [None if getattr(tokens, n) is None else getattr(tokens, n).tolist() for n in names] + [
        tokens.sampled_start
    ]


def _nodes(trajectory: Trajectory) -> list:
    return [
        (n.parent, n.author, n.message, n.delta_hash, n.calls, _arrays(n.tokens))
        for n in trajectory.graph
    ]


def test_a_token_mode_episode_replays_to_the_same_nodes_and_arrays(
    token_server_options: Callable[..., ServerOptions], tmp_path: Path
) -> None:
    records = tmp_path / "records"
    options = token_server_options(record_dir=records)
    with ServerThread(options) as server, Control(server.url) as control:
        created = control.create(meta={"task": "x"})
        client = openai.OpenAI(
            base_url=created["base_url"], api_key=created["api_key"], max_retries=0
        )
        messages: list[Any] = [{"role": "user", "content": "find x"}]
        for turn in range(3):
            reply = client.chat.completions.create(model="p", messages=messages)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": f"again {turn}"})
        # The same request once more: its call joins a node the journal already holds.
        client.chat.completions.create(model="p", messages=messages[:-1])
        # Read while the server runs, as a restart after kill -9 would find it.
        replayed = read_journal(records, created["id"])
        result = control.finish(created["id"]).json()
    written = load_trajectory(records, created["id"])
    assert replayed.meta == {"task": "x"} and replayed.status == "open"
    assert replayed.failures[-1]["error"] == RECOVERED
    assert sum(len(n.calls) for n in written.graph) == 4
    assert _nodes(replayed) == _nodes(written)
    assert any(n.tokens is not None and n.tokens.experts is not None for n in written.graph)
    assert result["record"] is not None
    assert not journal_paths(records, created["id"])[0].exists()  # removed once written


def _token_node(graph: Graph, parent: int | None, n: int, placeholder: bool = False):
    return graph.add(
        parent,
        author=CLIENT if parent is None else MODEL,
        message={"role": "user" if parent is None else "assistant", "content": str(n)},
        match_hash=f"{n:032x}",
        delta_hash=f"{n:032x}",
        created_at=1.0,
        tokens=Tokens(
            ids=[n, n + 1],
            sampled_start=None if parent is None else 1,
            logprobs=None if parent is None else [0.0, -0.5],
            experts=np.full((2, 3, 2), n, dtype=np.uint8),
            experts_placeholder=placeholder,
        ),
    )


def test_torn_lines_and_arrays_are_dropped_and_filled_expert_rows_kept(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    trajectory = Trajectory(TR, capture={"mode": "tokens"}, meta={"k": 1})
    journal.open(trajectory)
    root = _token_node(trajectory.graph, None, 1, placeholder=True)
    model = _token_node(trajectory.graph, root.id, 2)
    model.calls.append({"t_start": 1.0, "t_end": 2.0})
    journal.append(trajectory, 1)
    root.tokens.experts[-1] = 9  # the next call forwards the real row
    root.tokens.experts_placeholder = False
    second = _token_node(trajectory.graph, model.id, 3)
    second.calls.append({"t_start": 3.0, "t_end": 4.0})
    journal.append(trajectory, 2)

    back = read_journal(tmp_path, TR)
    assert _nodes(back) == _nodes(trajectory)
    assert back.graph[0].tokens.experts[-1].tolist() == [[9, 9]] * 3

    lines, arrays = journal_paths(tmp_path, TR)
    whole = lines.read_bytes()
    lines.write_bytes(whole[:-5])  # the last line cut off mid-write
    assert len(read_journal(tmp_path, TR).graph) == 2
    lines.write_bytes(whole)
    arrays.write_bytes(arrays.read_bytes()[:-1])  # its arrays never all reached the disk
    torn = read_journal(tmp_path, TR)
    assert len(torn.graph) == 2 and torn.graph[0].tokens.experts_placeholder is True


def test_a_running_servers_journals_are_never_replayed(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.open(Trajectory(TR, capture={"mode": "text"}))
    assert pending_journals(tmp_path) == []  # its server holds the lock
    written: list[str] = []
    assert replay_journals(tmp_path, lambda t: written.append(t.id)).written == []
    journal.close()
    assert pending_journals(tmp_path) == [TR]
    result = replay_journals(tmp_path, lambda t: write_record(t, tmp_path))
    assert result.written == [TR] and not journal_paths(tmp_path, TR)[0].exists()
    assert load_trajectory(tmp_path, TR).status == "open"


def test_a_replay_that_cannot_write_keeps_the_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.open(Trajectory(TR, capture={"mode": "text"}))
    journal.close()

    def full(trajectory: Trajectory) -> None:
        raise OSError(28, "No space left on device")

    result = replay_journals(tmp_path, full)
    assert [t.id for t in result.unwritten] == [TR]
    assert journal_paths(tmp_path, TR)[0].exists()


def test_a_failed_write_is_made_good_by_the_next_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(tmp_path)
    trajectory = Trajectory(TR, capture={"mode": "tokens"})
    journal.open(trajectory)
    root = _token_node(trajectory.graph, None, 1)
    model = _token_node(trajectory.graph, root.id, 2)
    model.calls.append({"t_start": 1.0, "t_end": 2.0})
    real = Journal._write

    def full(self, path, *parts, truncate=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Journal, "_write", full)
    with pytest.raises(OSError):
        journal.append(trajectory, 1)
    assert journal.broken(TR)
    monkeypatch.setattr(Journal, "_write", real)
    second = _token_node(trajectory.graph, model.id, 3)
    second.calls.append({"t_start": 3.0, "t_end": 4.0})
    journal.append(trajectory, 2)
    assert not journal.broken(TR)
    assert _nodes(read_journal(tmp_path, TR)) == _nodes(trajectory)

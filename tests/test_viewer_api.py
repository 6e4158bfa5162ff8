"""The viewer JSON API over records written by skycap: every flag, group verdict, view, route."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from test_viewer_fixtures import GRPO, MIXED, grpo_id, make_runs

from skycap.record.reader import read_document, read_sidecar
from skycap.viewer.server import ViewerServer, make_server


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_runs(tmp_path_factory.mktemp("viewer"))


@pytest.fixture(scope="module")
def server(runs: dict[str, Path]) -> Iterator[ViewerServer]:
    root = runs["grpo"].parent
    srv = make_server([root], port=0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def client(server: ViewerServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url.rstrip("/"), timeout=10) as http:
        yield http


def get(client: httpx.Client, path: str, status: int = 200) -> Any:
    response = client.get(path)
    assert response.status_code == status, response.text
    return response.json()


def rows_by_id(client: httpx.Client, run: str) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in get(client, f"/api/v1/runs/{run}/trajectories")["rows"]}


def test_runs_are_named_after_directories_and_know_their_default_view(client):
    runs = {run["name"]: run for run in get(client, "/api/v1/runs")["runs"]}
    assert set(runs) == {"grpo", "mirror", "mixed"}  # mixed/skycap is named after its parent
    assert runs["grpo"]["trajectories"] == sum(map(len, GRPO.values()))
    assert runs["grpo"]["default_view"] == "groups" and runs["grpo"]["groupable"]
    assert runs["mixed"]["default_view"] == "rollouts" and not runs["mixed"]["groupable"]
    assert runs["mixed"]["modes"] == {"text": 2, "tokens": len(MIXED) - 2}


EXPECTED_FLAGS = {
    "text_linear": [],
    "text_forked": ["truncated", "forked"],
    "failed": ["failed-calls"],
    "abandoned": ["abandoned"],
    "open": ["incomplete"],
    "empty": ["empty"],
    "unbridged": ["unbridged"],
    "unbridged_resample": ["unbridged-expected", "forked"],
    "inferred": ["unbridged-inferred", "replayed", "forked", "bridged-unknown"],
    "replayed": ["replayed"],
    "no_logprobs": ["no-logprobs"],
    "no_train": ["no-train", "forked"],
    "final_rule": ["forked"],
    "masked_tokens": [],
    "malformed": ["malformed-record"],
    "train_twice": ["no-train", "forked"],
    "unlisted": ["malformed-record"],
}


def test_every_rollout_flag_follows_viewer_md(client):
    assert set(EXPECTED_FLAGS) == set(MIXED)
    detail_flags = {
        name: [
            f["flag"]
            for f in get(client, f"/api/v1/runs/mixed/trajectories/{MIXED[name]}")["flags"]
        ]
        for name in MIXED
    }
    assert detail_flags == EXPECTED_FLAGS
    rows = rows_by_id(client, "mixed")
    # Table rows leave the quiet `bridged-unknown` off.
    assert rows[MIXED["inferred"]]["flags"] == ["unbridged-inferred", "replayed", "forked"]
    assert rows[MIXED["failed"]]["status"] == "failed"


def test_a_mirror_without_tokens_sidecars_flags_tokens_missing(client):
    row = rows_by_id(client, "mirror")[grpo_id(1, "a", 0, 0)]
    assert row["flags"] == ["tokens-missing", "forked"]
    detail = get(client, f"/api/v1/runs/mirror/trajectories/{grpo_id(1, 'a', 0, 0)}")
    assert detail["absent_sidecars"] == ["tokens"]
    assert detail["text_only"] == "tokens-missing"
    assert detail["warning"] == "tokens sidecar missing: showing message text only"
    assert detail["problems"] == []


def groups(client: httpx.Client, query: str = "") -> dict[str, Any]:
    return get(client, f"/api/v1/runs/grpo/groups{query}")


def test_group_verdicts_follow_viewer_md(client):
    data = groups(client)
    by_key = {g["key"]: g for g in data["groups"]}
    # Default order: step descending, then task, then key.
    assert [g["key"] for g in data["groups"]] == ["2~a", "1~a", "1~b", "1~c", "1~d"]
    assert data["modal"] == 4
    assert {k: g["flags"] for k, g in by_key.items()} == {
        "2~a": ["retried"],  # the superseded attempt stopped with `error`: it does not mask
        "1~a": [],
        "1~b": ["no-signal"],
        "1~c": ["masked"],
        "1~d": ["short"],
    }
    assert by_key["1~d"]["size"] == 3 and by_key["1~d"]["modal"] == 4
    assert by_key["1~a"]["rollup"] == {"forked": 1}
    assert by_key["1~a"]["binary"] and by_key["1~a"]["pass"] == 3
    assert not by_key["2~a"]["binary"] and by_key["2~a"]["pass"] is None
    assert by_key["1~c"]["rewards"] == [1.0, 0.0, 1.0, 0.0]  # repetition order
    assert [d["repetition"] for d in by_key["1~c"]["dots"]] == ["0", "1", "2", "3"]
    assert by_key["1~a"]["task"] == "a.json" and by_key["1~a"]["step"] == 1
    health = {h["flag"]: h["count"] for h in data["health"]}
    assert health == {"no-signal": 1, "masked": 1, "short": 1, "retried": 1, "forked": 1}


def test_superseded_attempts_follow_the_attempt_that_counts(client):
    rows = {g["key"]: g for g in groups(client)["groups"]}["2~a"]["rollouts"]
    counting, superseded = grpo_id(2, "a", 0, 1), grpo_id(2, "a", 0, 0)
    ids = [r["id"] for r in rows]
    assert ids.index(superseded) == ids.index(counting) + 1
    assert rows[ids.index(superseded)]["superseded_by"] == counting
    assert [r["reward"] for r in rows if r["superseded_by"] is None] == [1.0, 1.0, 0.5, 0.0]
    detail = get(client, f"/api/v1/runs/grpo/trajectories/{superseded}")
    assert detail["group"]["superseded_by"] == counting and detail["group_flags"] == []
    detail = get(client, f"/api/v1/runs/grpo/trajectories/{counting}")
    assert detail["group"]["supersedes"] == [superseded]
    assert detail["group_flags"] == ["retried"]


def test_filters_match_groups_through_their_rollouts_and_health_counts_before_the_flag(client):
    assert [g["key"] for g in groups(client, "?step=2")["groups"]] == ["2~a"]
    assert [g["key"] for g in groups(client, "?task=b.json")["groups"]] == ["1~b"]
    masked = groups(client, "?ann=stop_reason%3Dagent_timeout")
    assert [g["key"] for g in masked["groups"]] == ["1~c"]
    # The superseded attempt matches the filter, so its group is listed.
    assert [g["key"] for g in groups(client, "?ann=stop_reason%3Derror")["groups"]] == ["2~a"]
    flagged = groups(client, "?flag=short")
    assert [g["key"] for g in flagged["groups"]] == ["1~d"]
    assert flagged["health"] == groups(client)["health"]
    free = groups(client, f"?q={grpo_id(1, 'b', 2, 0)}")
    assert [g["key"] for g in free["groups"]] == ["1~b"]


def test_group_sorts_use_mean_reward_and_the_largest_rollout(client):
    by_reward = [g["key"] for g in groups(client, "?sort=reward&order=desc")["groups"]]
    assert by_reward == ["1~a", "2~a", "1~c", "1~d", "1~b"]
    by_reward = [g["key"] for g in groups(client, "?sort=reward&order=asc")["groups"]]
    assert by_reward == ["1~b", "1~d", "1~c", "2~a", "1~a"]
    assert [g["key"] for g in groups(client, "?sort=tokens")["groups"]][0] == "1~a"


def test_group_by_from_the_query(client):
    data = groups(client, "?group_by=instance_id")
    assert {g["key"]: g["size"] for g in data["groups"]} == {"a": 4, "b": 4, "c": 4, "d": 3}
    assert {g["key"]: g["flags"] for g in data["groups"]}["a"] == ["retried"]


def test_rollouts_sort_with_nulls_last_and_paginate(client):
    rows = get(client, "/api/v1/runs/mixed/trajectories?sort=reward&order=asc")["rows"]
    assert [r["reward"] for r in rows[:2]] == [0.25, 0.75]
    assert all(r["reward"] is None for r in rows[2:])
    rows = get(client, "/api/v1/runs/mixed/trajectories?sort=reward&order=desc")["rows"]
    assert [r["reward"] for r in rows[:2]] == [0.75, 0.25]
    data = get(client, "/api/v1/runs/mixed/trajectories?sort=health")
    assert data["rows"][0]["flags"][0] in (
        "failed-calls",
        "incomplete",
        "no-logprobs",
        "malformed-record",
    )
    assert (data["page"], data["pages"], data["total"]) == (1, 1, len(MIXED))


def test_rollout_rows_carry_their_group_flags(client):
    rows = get(client, "/api/v1/runs/grpo/trajectories?flag=masked")["rows"]
    assert {r["id"] for r in rows} == {grpo_id(1, "c", r, 0) for r in range(4)}
    assert all(r["group_flags"] == ["masked"] for r in rows)


@pytest.mark.parametrize(
    "query, message",
    [
        ("?sort=bogus", "unknown sort 'bogus'"),
        ("?order=up", "unknown order 'up'"),
        ("?page=0", "page 0 is out of range"),
        ("?flag=nope", "unknown flag 'nope'"),
        ("?ann=reward", "needs the form key=value"),
        ("?step=x", "step filter 'x' is not a number"),
    ],
)
def test_bad_queries_are_400_with_a_reason(client, query, message):
    assert message in get(client, f"/api/v1/runs/grpo/groups{query}", 400)["error"]


def decode_token_texts(data: dict[str, Any]) -> list[str]:
    """Each token's text, sliced as JavaScript would (UTF-16 code units)."""
    units = data["text"].encode("utf-16-le")
    starts = data["offsets"] + [len(units) // 2]
    return [
        units[2 * a : 2 * b].decode("utf-16-le")
        for a, b in zip(starts[:-1], starts[1:], strict=True)
    ]


def test_path_blocks_and_compact_tokens_match_the_sidecar(client, runs):
    doc_id = grpo_id(1, "a", 0, 0)
    data = get(client, f"/api/v1/runs/grpo/trajectories/{doc_id}/paths/1")
    assert data["id"] == f"{doc_id}-p0001" and data["unit"] == "tokens"
    assert [b["kind"] for b in data["blocks"]] == ["given", "scaffold", "sampled"]
    tokens = data["token_data"]
    document = read_document(runs["grpo"] / f"{doc_id}.json.zst")
    arrays = read_sidecar(runs["grpo"], document, "tokens")
    node_ids = [document["nodes"][i]["tokens"] for i in data["nodes"]]
    expected = np.concatenate(
        [arrays["token_ids"][t["offset"] : t["offset"] + t["length"]] for t in node_ids]
    )
    assert tokens["ids"] == expected.tolist() and tokens["count"] == len(expected)
    assert tokens["logprobs"][: data["blocks"][0]["end"]] == [None] * data["blocks"][0]["end"]
    assert tokens["logprobs"][data["blocks"][1]["start"] : data["blocks"][1]["end"]] == [0.0] * 3
    texts = decode_token_texts(tokens)
    assert "".join(texts) == tokens["text"]
    # " 🙂" spans three tokens; a token whose bytes only start the character gets an empty
    # span, the token that completes it gets the whole character.
    emoji = texts.index("🙂")
    assert texts[emoji - 3 : emoji + 1] == [" try", " ", "", "🙂"]
    assert "fférent." in "".join(texts[emoji:])
    assert data["tokens"] == len(expected) and data["trainable"] == data["logprobs"] > 0


def test_a_later_path_marks_shared_replies_sampled_elsewhere(client):
    data = get(client, f"/api/v1/runs/mixed/trajectories/{MIXED['no_train']}/paths/1")
    kinds = [(b["kind"], b["node"], b.get("trained_in")) for b in data["blocks"]]
    assert kinds == [
        ("given", 0, None),
        ("scaffold", 1, None),
        ("sampled-elsewhere", 1, 0),
        ("given", 3, None),
    ]
    assert data["trainable"] == 0


def test_text_only_fallbacks_draw_message_text_with_a_warning(client):
    doc_id = grpo_id(1, "a", 0, 0)
    data = get(client, f"/api/v1/runs/mirror/trajectories/{doc_id}/paths/0")
    assert data["unit"] == "chars" and data["token_data"] is None
    assert data["text_only"] == "tokens-missing"
    assert data["warning"] == "tokens sidecar missing: showing message text only"
    first = data["blocks"][0]
    assert first["text"] == "Solve the task carefully: a0."
    assert first["end"] - first["start"] == len(first["text"])
    unlisted = get(client, f"/api/v1/runs/mixed/trajectories/{MIXED['unlisted']}/paths/0")
    assert unlisted["text_only"] == "tokens-unlisted" and unlisted["unit"] == "chars"
    text = get(client, f"/api/v1/runs/mixed/trajectories/{MIXED['text_linear']}/paths/0")
    assert (text["unit"], text["text_only"], text["warning"]) == ("chars", None, None)
    assert [b["kind"] for b in text["blocks"]] == ["given", "sampled", "given", "sampled"]


def test_train_once_check(client):
    def check(name: str) -> str:
        return get(client, f"/api/v1/runs/mixed/trajectories/{MIXED[name]}")["train_once"]["text"]

    assert check("text_forked") == (
        "Train-once holds: each of the 2 model nodes is trained in exactly one path"
    )
    assert check("final_rule") == "Train-once holds, but n1 is trained in no path"
    assert check("train_twice") == "Train-once violated: n1 is trained in 2 paths"


def test_detail_lists_record_problems(client):
    detail = get(client, f"/api/v1/runs/mixed/trajectories/{MIXED['malformed']}")
    assert detail["problems"] == [
        "node 1 slices into sampling_mask, which is not in the sidecars manifest"
    ]
    assert detail["document"]["id"] == MIXED["malformed"]
    assert rows_by_id(client, "mixed")[MIXED["malformed"]]["problems"] == 1


def test_graph_marks_signs_forks_and_branch_points(client):
    graph = get(client, f"/api/v1/runs/mixed/trajectories/{MIXED['inferred']}/graph")
    signs = {n["id"]: n["signs"] for n in graph["nodes"] if n["signs"]}
    assert signs == {2: ["re-tokenized copy of n1"], 4: ["unbridged (inferred)"]}
    assert graph["branch_points"] == [0]
    assert graph["forks"] == [
        {
            "node": 2,
            "parent": 0,
            "vs": 1,
            "cause": "re-rendered",
            "detail": "the same message, rendered to different tokens",
        }
    ]
    assert [c["bridged"] for c in graph["nodes"][4]["calls"]] == ["absent"]
    assert [p["nodes"] for p in graph["paths"]] == [[0, 1], [0, 2, 3, 4]]
    unbridged = get(client, f"/api/v1/runs/mixed/trajectories/{MIXED['unbridged']}/graph")
    assert unbridged["nodes"][3]["signs"] == ["unbridged"]


def test_calls_and_failures_sorted_by_time(client):
    calls = get(client, f"/api/v1/runs/mixed/trajectories/{MIXED['failed']}/calls")["calls"]
    assert [c["kind"] for c in calls] == ["call", "call", "failure"]
    assert [c["bridged"] for c in calls[:2]] == [None, True]
    assert calls[0]["duration_ms"] == pytest.approx(1500.0)
    assert calls[2]["error"] == "token attribution: mismatch" and calls[2]["node"] is None


def test_the_server_is_read_only_and_answers_unknowns_with_404(client):
    response = client.post("/api/v1/runs")
    assert response.status_code == 405 and response.headers["allow"] == "GET, HEAD"
    head = client.head("/api/v1/runs")
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) > 0
    assert "no run named 'nope'" in get(client, "/api/v1/runs/nope/groups", 404)["error"]
    get(client, "/api/v1/runs/grpo/trajectories/..%2F..%2Fetc", 404)
    get(client, "/api/v1/runs/grpo/trajectories/tr_0000000000000000", 404)
    get(client, f"/api/v1/runs/mixed/trajectories/{MIXED['empty']}/paths/0", 404)
    get(client, "/api/v1/nothing", 404)
    assert client.get("/static/../server.py").status_code == 404
    page = client.get("/")
    assert page.status_code == 200 and b'type="module"' in page.content
    assert client.get("/static/app.js").headers["content-type"].startswith("text/javascript")


def test_a_re_render_a_compaction_explains_is_a_note_not_a_sign(tmp_path: Path):
    """The call after a compaction renders in full by design: grey note, no warning sign."""
    from test_viewer_fixtures import Build, tid

    from skycap.viewer.index import Index
    from skycap.viewer.server import Viewer

    b = Build(tid(1))
    system = b.client(None, "You are an agent.", role="system")
    task = b.client(system, "Investigate.")
    asked = b.model(task, "searching")
    result = b.client(asked, "notes", role="tool")
    b.model(result, "more")
    summary = b.client(system, "Summary of the work so far.")
    after = b.model(summary, "done", bridged=False)
    b.write(tmp_path / "run")
    viewer = Viewer(Index([tmp_path / "run"]))
    graph = viewer.graph("run", tid(1))
    assert [f["cause"] for f in graph["forks"]] == ["compaction"]
    node = graph["nodes"][after]
    assert node["signs"] == [] and node["notes"] == ["re-rendered as expected: compaction"]
    assert [c["rerender"] for c in node["calls"]] == ["compaction"]
    calls = viewer.calls("run", tid(1))["calls"]
    assert [c["rerender"] for c in calls if c["node"] == after] == ["compaction"]


def test_ungrouped_rollouts_flags_count_in_the_groups_band(client):
    """A run's rollouts without step/instance_id are no group, but what went wrong in them
    shows in the Groups view's band, and the answer says how many are not shown."""
    groups = get(client, "/api/v1/runs/mixed/groups")
    rollouts = get(client, "/api/v1/runs/mixed/trajectories")
    assert groups["total"] == 0 and groups["ungrouped"] == rollouts["total"]
    band = {h["flag"]: h["count"] for h in groups["health"]}
    assert band["incomplete"] == 1 and band["failed-calls"] == 1
    assert groups["ungrouped_health"] == groups["health"]
    assert "bridged-unknown" not in band  # quiet flags stay out, as on rollout rows

"""Control routes over real sockets: create, health, listing, documents and finish rules."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from server_fixtures import Control, make_server, upstream

from skycap.logqueue import flush_log_queue
from skycap.mock.upstream import ScriptedUpstream

MESSAGES = [{"role": "user", "content": "hello"}]


def chat(
    trajectory: dict[str, Any], messages: list[dict] = MESSAGES, **body: Any
) -> httpx.Response:
    return httpx.post(
        f"{trajectory['base_url']}/chat/completions",
        json={"model": "m", "messages": messages, **body},
        headers={"Authorization": f"Bearer {trajectory['api_key']}"},
        timeout=10,
    )


def first_leaf_rule(graph):
    """Custom path rule: the first leaf's path, training its last node."""
    path = graph.path_to(graph.leaves()[0])
    return [(path, [path[-1]])]


def broken_rule(graph):
    return [([99], [])]


@pytest.fixture
def control(make_server) -> Control:
    server = make_server(path_rules={"first": f"{__name__}:first_leaf_rule", "bad": broken_rule})
    client = Control(server.url)
    yield client
    client.close()


def test_create_hands_out_the_address_the_trainer_used(control: Control) -> None:
    response = control.http.post(
        "/trajectories", json={"meta": {"task": 7}}, headers={"Host": "trainer.example:9999"}
    )
    assert response.status_code == 200
    created = response.json()
    assert created["base_url"] == f"http://trainer.example:9999/t/{created['id']}/v1"
    assert created["id"].startswith("tr_") and len(created["id"]) == 19
    assert created["api_key"].startswith("sk-skycap-")
    assert set(created) == {"id", "base_url", "anthropic_base_url", "api_key"}
    assert created["anthropic_base_url"] == f"http://trainer.example:9999/t/{created['id']}"
    document = control.document(created["id"]).json()
    assert document["meta"] == {"task": 7} and document["status"] == "open"
    assert "format_version" not in document and "sidecars" not in document
    assert "api_key" not in control.document(created["id"]).text


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"", 200, None),
        (b"{}", 200, None),
        (b'{"meta": null}', 200, None),
        (b"{nope", 400, "request body is not JSON"),
        (b"[1]", 400, "request body must be a JSON object"),
        (b'{"meta": [1]}', 400, "`meta` must be an object"),
    ],
)
def test_create_checks_its_body(control: Control, body: bytes, status: int, message: str) -> None:
    response = control.http.post("/trajectories", content=body)
    assert response.status_code == status
    if message is not None:
        assert response.json()["error"].startswith(message)


def test_health_and_listing(control: Control) -> None:
    older, newer = control.create({"n": 1}), control.create({"n": 2})
    assert chat(newer).status_code == 200
    health = control.http.get("/healthz").json()
    assert health["ok"] is True and health["capture"] == {"mode": "text"}
    assert health["open_trajectories"] == 2
    assert health["calls_total"] == 1 and health["failures_total"] == 0
    assert health["tokens_total"] > 0
    listing = control.http.get("/trajectories").json()
    assert [row["id"] for row in listing] == [newer["id"], older["id"]]
    row = listing[0]
    assert row["calls"] == 1 and row["nodes"] == 2 and row["paths"] == 1
    assert row["failures"] == 0 and row["unbridged_calls"] == 0 and row["meta"] == {"n": 2}
    assert row["last_call"]["finish_reason"] == "stop" and row["last_call"]["latency_ms"] > 0
    assert listing[1]["last_call"] is None
    assert row["age_s"] >= 0 and row["last_activity"] >= row["created_at"]


def test_unmatched_routes_answer_404_and_nothing_is_forwarded(
    control: Control, upstream: ScriptedUpstream
) -> None:
    for method, path in [
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("DELETE", "/trajectories/tr_0123456789abcdef"),
        ("GET", "/trajectories/tr_0123456789abcdef/finish"),
    ]:
        response = control.http.request(method, path)
        assert response.status_code == 404, path
        assert response.json()["error"].startswith("no route")
    harness = control.http.get("/t/tr_0123456789abcdef/v1/embeddings")
    assert harness.status_code == 404
    assert harness.json()["error"]["type"] == "invalid_request_error"
    for bad in ["tr_nothex", "..", "tr_0123456789ABCDEF", "%2e%2e"]:
        assert control.document(bad).status_code == 404
        assert control.finish(bad).status_code == 404
    assert control.finish("tr_nothex").json() == {"error": "unknown trajectory"}
    assert upstream.requests == []


def test_finish_returns_samples_and_repeats_identically(control: Control) -> None:
    trajectory = control.create()
    reply = chat(trajectory).json()["choices"][0]["message"]
    first = control.finish(trajectory["id"], annotations={"reward": 1.0})
    assert first.status_code == 200
    body = first.json()
    assert body["status"] == "finished" and body["record"] is None and body["unbridged_calls"] == 0
    assert body["samples"] == [
        {"leaf": 1, "path": [0, 1], "messages": [MESSAGES[0], reply], "targets": [1]}
    ]
    again = control.finish(trajectory["id"], annotations={"reward": 1.0}, paths="all")
    assert again.json() == body
    assert control.finish(trajectory["id"]).json() == body  # {} adds nothing
    changed = control.finish(trajectory["id"], annotations={"reward": 0.0})
    assert changed.status_code == 409 and "cannot change" in changed.json()["error"]
    other_rule = control.finish(trajectory["id"], paths="final")
    assert other_rule.status_code == 409
    assert other_rule.json() == {"error": "trajectory already finished with paths='all'"}
    # A value not there yet may still be added after the end.
    added = control.finish(trajectory["id"], annotations={"judge": "ok"})
    assert added.status_code == 200
    assert control.document(trajectory["id"]).json()["annotations"] == {
        "reward": 1.0,
        "judge": "ok",
    }
    after = chat(trajectory)
    assert after.status_code == 410 and after.json()["error"]["code"] == "trajectory_closed"
    assert after.json()["error"]["message"] == "trajectory is finished"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{x", "request body is not JSON"),
        (b'{"annotations": [1]}', "`annotations` must be an object"),
        (b'{"paths": 3}', "`paths` must be a string"),
        (b'{"paths": "longest"}', "`paths` must be one of [all, final, first, bad]"),
    ],
)
def test_finish_refusals_leave_the_trajectory_open(
    control: Control, body: bytes, message: str
) -> None:
    trajectory = control.create()
    response = control.http.post(f"/trajectories/{trajectory['id']}/finish", content=body)
    assert response.status_code == 400
    assert response.json()["error"].startswith(message)
    assert control.document(trajectory["id"]).json()["status"] == "open"
    assert chat(trajectory).status_code == 200


def test_custom_and_final_rules(control: Control) -> None:
    trajectory = control.create()
    chat(trajectory, [{"role": "user", "content": "a"}])
    chat(trajectory, [{"role": "user", "content": "b"}])
    result = control.finish(trajectory["id"], paths="first").json()
    assert [(s["path"], s["targets"]) for s in result["samples"]] == [([0, 1], [1])]
    # A repeat without `paths` means the recorded rule.
    assert control.finish(trajectory["id"]).json() == result
    other = control.create()
    chat(other, [{"role": "user", "content": "a"}])
    chat(other, [{"role": "user", "content": "b"}])
    final = control.finish(other["id"], paths="final").json()
    assert [(s["path"], s["targets"]) for s in final["samples"]] == [([2, 3], [3])]


def test_failing_rule_is_500_and_a_later_finish_can_still_sample(control: Control) -> None:
    trajectory = control.create()
    chat(trajectory)
    failed = control.finish(trajectory["id"], paths="bad")
    assert failed.status_code == 500
    error = failed.json()
    assert error["code"] == "path_rule_failed"
    assert error["error"].startswith("path rule 'bad' failed: ValueError: ")
    document = control.document(trajectory["id"]).json()
    assert document["status"] == "finished" and document["samples"] is None
    retried = control.finish(trajectory["id"], paths="all")
    assert retried.status_code == 200 and len(retried.json()["samples"]) == 1


def test_keep_unrecorded_false_drops_finished_trajectories(make_server) -> None:
    server = make_server(keep_unrecorded=False)
    control = Control(server.url)
    trajectory = control.create()
    assert control.finish(trajectory["id"]).status_code == 200
    assert control.document(trajectory["id"]).status_code == 404
    assert chat(trajectory).status_code == 404
    control.close()


def test_one_access_line_per_harness_call_at_info(control: Control, caplog) -> None:
    import logging

    trajectory = control.create()
    chat(trajectory)  # at the default level: no access line
    caplog.set_level(logging.INFO, logger="skycap.access")
    chat(trajectory)
    control.http.get("/healthz")
    assert flush_log_queue()  # the server's log lines reach caplog from the writer thread
    lines = [r.getMessage() for r in caplog.records if r.name == "skycap.access"]
    assert len(lines) == 1
    assert re.fullmatch(rf"POST /t/{trajectory['id']}/v1/chat/completions 200 [\d.]+ ms", lines[0])


def test_idle_time_and_the_ring_of_recently_ended(control: Control) -> None:
    kept, done = control.create({"n": 1}), control.create({"n": 2})
    assert chat(done).status_code == 200
    rows = {row["id"]: row for row in control.http.get("/trajectories").json()}
    assert rows[kept["id"]]["last_failure"] is None and rows[kept["id"]]["idle_s"] >= 0
    assert control.finish(done["id"]).status_code == 200
    ended = control.http.get("/trajectories?ended=recent").json()
    assert [row["id"] for row in ended][:1] == [done["id"]]
    assert ended[0]["status"] == "finished" and ended[0]["calls"] == 1
    assert ended[0]["ended_at"] >= ended[0]["created_at"]
    assert ended[0]["record"] is None  # no record dir: the record stays in memory
    wrong = control.http.get("/trajectories?ended=all")
    assert wrong.status_code == 400 and "`ended` must be `recent`" in wrong.json()["error"]

"""Bad input, upstream failures, retries, cancellation: the server keeps serving, records right."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest
from server_fixtures import Control, control, make_server, upstream, wait_for

from skycap.mock.upstream import ScriptedUpstream
from skycap.server.retry import REUSED_KEY

GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
LIMIT = 4096


@pytest.fixture
def server(make_server):
    return make_server(upstream_timeout=0.5, max_body_size=LIMIT)


def post(trajectory: dict[str, Any], content: Any = None, **kwargs: Any) -> httpx.Response:
    if content is None and "json" not in kwargs:
        kwargs["json"] = GOOD
    return httpx.post(
        f"{trajectory['base_url']}/chat/completions", content=content, timeout=10, **kwargs
    )


def state(server, trajectory: dict[str, Any]) -> dict[str, Any]:
    return server.run_in_loop(
        lambda: server.store.get(trajectory["id"]).trajectory.document(live=True)
    )


def big_body(size: int) -> bytes:
    return b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * size + b'"}]}'


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "request body is not JSON"),
        (b"", "request body is not JSON: the body is empty"),
        (b"[1, 2]", "request body must be a JSON object"),
        (b'{"model": "m"}', "`messages` must be a list of objects"),
        (b'{"messages": "hi"}', "`messages` must be a list of objects"),
        (b'{"messages": ["hi"]}', "`messages` must be a list of objects"),
        (b'{"messages": [], "n": 2}', "`n` > 1 is not supported"),
        (b'{"messages": [], "n": null}', "`n` > 1 is not supported"),
        (b'{"messages": [{"content": "\\ud800"}]}', "request body is not JSON"),
    ],
)
def test_bad_bodies_are_400_and_leave_nothing(
    server, control: Control, upstream: ScriptedUpstream, content: bytes, message: str
) -> None:
    trajectory = control.create()
    response = post(trajectory, content)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith(message)
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert upstream.requests == []
    assert post(trajectory).status_code == 200  # still serving
    document = state(server, trajectory)
    assert len(document["nodes"]) == 2 and document["failures"] == []


def test_oversize_bodies_are_413_naming_the_limit(server, control: Control) -> None:
    trajectory = control.create()
    announced = post(trajectory, big_body(LIMIT * 50), headers={"content-type": "application/json"})
    assert announced.status_code == 413
    assert f"over the limit of {LIMIT} bytes" in announced.json()["error"]["message"]
    assert "--max-body-size" in announced.json()["error"]["message"]

    def chunks():
        yield big_body(LIMIT)

    chunked = post(trajectory, chunks())
    assert chunked.status_code == 413
    assert f"of {len(big_body(LIMIT))} bytes" in chunked.json()["error"]["message"]
    control_route = control.http.post("/trajectories", content=b"{" + b" " * LIMIT * 2 + b"}")
    assert control_route.status_code == 413 and "error" in control_route.json()
    assert post(trajectory).status_code == 200
    assert state(server, trajectory)["failures"] == []


def test_gating_order_and_unknown_ids(control: Control) -> None:
    trajectory = control.create()
    base = control.url
    unknown = httpx.post(f"{base}/t/tr_0123456789abcdef/v1/chat/completions", json=GOOD)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "unknown trajectory"
    for bad in ["tr_XYZ", "tr_0123456789abcdef0", "..%2F..%2Fetc", "tr_%2e%2e"]:
        response = httpx.post(f"{base}/t/{bad}/v1/chat/completions", json=GOOD)
        assert response.status_code == 404, bad
    # Step 2 comes before step 4: a closed trajectory answers 410 even to a bad body.
    control.finish(trajectory["id"])
    closed = post(trajectory, b"{not json")
    assert closed.status_code == 410 and closed.json()["error"]["code"] == "trajectory_closed"


@pytest.mark.parametrize(
    ("fault", "stream", "failure"),
    [
        (
            {"kind": "status", "status": 500},
            False,
            '{"error":{"message":"scripted upstream fault: HTTP 500"',
        ),
        (
            {"kind": "status", "status": 401},
            True,
            '{"error":{"message":"scripted upstream fault: HTTP 401"',
        ),
        ({"kind": "garbage"}, False, "unreadable reply: the body is not JSON"),
        ({"kind": "no_choices"}, False, "unreadable reply: no choices in the body"),
        ({"kind": "garbage"}, True, "unreadable stream: a data payload is not JSON"),
        ({"kind": "no_choices"}, True, "unreadable stream: no finish_reason"),
        ({"kind": "break_stream"}, True, "upstream stream interrupted: "),
        ({"kind": "break_stream"}, False, "upstream: "),
        ({"kind": "hang"}, False, "upstream: timed out after 0.5 s"),
        ({"kind": "hang"}, True, "upstream: timed out after 0.5 s"),
    ],
)
def test_upstream_failures_are_recorded_and_the_trajectory_stays_open(
    server, control: Control, upstream: ScriptedUpstream, fault: dict, stream: bool, failure: str
) -> None:
    trajectory = control.create()
    upstream.fail_next(**fault)
    with httpx.stream(
        "POST",
        f"{trajectory['base_url']}/chat/completions",
        json={**GOOD, "stream": stream},
        timeout=10,
    ) as response:
        status = response.status_code
        try:
            body = response.read()
        except httpx.RemoteProtocolError:
            body = None  # a broken stream: the harness sees a failed stream, not a short one
    document = state(server, trajectory)
    assert [f["error"][: len(failure)] for f in document["failures"]] == [failure]
    assert document["nodes"] == [] and document["status"] == "open"
    if fault["kind"] == "status":
        assert status == fault["status"] and document["failures"][0]["status"] == status
    elif fault["kind"] == "hang":
        assert status == 502
        assert body is not None
        assert httpx.Response(502, content=body).json()["error"] == {
            "message": "upstream unavailable: timed out after 0.5 s",
            "type": "api_error",
            "param": None,
            "code": None,
        }
    elif fault["kind"] == "break_stream" and stream:
        # The relayed stream ends with the OpenAI error event, never as a short stream.
        assert status == 200 and body is not None
        last = body.rstrip().rsplit(b"\n\n", 1)[-1]
        assert last.startswith(b"data: ") and b"upstream stream interrupted" in last
        assert httpx.Response(200, content=last[6:]).json()["error"]["type"] == "api_error"
    elif fault["kind"] == "break_stream":
        assert status == 502
    else:
        assert status == 200 and body  # passed through as is
    assert post(trajectory).status_code == 200
    assert server.run_in_loop(lambda: server.store.failures_total) == 1


def test_an_unreachable_upstream_is_502(make_server, upstream: ScriptedUpstream) -> None:
    base = upstream.base_url
    upstream.stop()
    server = make_server(upstream_url=base)
    control = Control(server.url)
    trajectory = control.create()
    response = post(trajectory)
    assert response.status_code == 502
    assert response.json()["error"]["message"].startswith("upstream unavailable: ")
    models = httpx.get(f"{trajectory['base_url']}/models")
    assert models.status_code == 502
    failures = state(server, trajectory)["failures"]
    assert len(failures) == 1 and failures[0]["error"].startswith("upstream: ")
    control.close()


def test_models_pass_through(control: Control, upstream: ScriptedUpstream) -> None:
    trajectory = control.create()
    models = httpx.get(f"{trajectory['base_url']}/models", headers={"Authorization": "Bearer mine"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "mock-model"
    assert upstream.requests[-1].path == "/v1/models"
    assert upstream.requests[-1].header("authorization") is None


def test_retries_are_answered_from_the_original(
    server, control: Control, upstream: ScriptedUpstream
) -> None:
    trajectory = control.create()
    raw = b'{"model": "m",   "messages": [{"role": "user", "content": "once"}]}'
    first = post(trajectory, raw, headers={"x-stainless-retry-count": "0"})
    again = post(trajectory, raw, headers={"x-stainless-retry-count": "1"})
    assert again.status_code == 200 and again.content == first.content
    assert len(upstream.requests) == 1 and upstream.requests[0].body == raw
    # The same body without a retry marker is a genuine resample: sampled again, same node.
    post(trajectory, raw)
    assert len(upstream.requests) == 2
    reused = post(trajectory, GOOD and b'{"messages": []}', headers={"Idempotency-Key": "k1"})
    assert reused.status_code == 200
    conflict = post(trajectory, raw, headers={"Idempotency-Key": "k1"})
    assert conflict.status_code == 400 and conflict.json()["error"]["message"] == REUSED_KEY
    document = state(server, trajectory)
    assert document["retries"] == {"replayed": 1, "coalesced": 0}


def test_a_retry_waits_for_its_running_original(make_server, upstream: ScriptedUpstream) -> None:
    server = make_server()
    trajectory = Control(server.url).create()
    upstream.fail_next("sleep", seconds=1.0)
    answers: list[httpx.Response] = []
    original = threading.Thread(target=lambda: answers.append(post(trajectory)))
    original.start()
    upstream.wait_for_requests(1)
    retry = post(trajectory, headers={"x-stainless-retry-count": "1"})
    original.join()
    assert retry.status_code == 200 and retry.content == answers[0].content
    assert len(upstream.requests) == 1
    assert state(server, trajectory)["retries"] == {"replayed": 1, "coalesced": 1}


def test_sdk_retries_after_a_server_error_sample_once(
    server, control: Control, upstream: ScriptedUpstream
) -> None:
    trajectory = control.create()
    upstream.fail_next("status", status=503)
    client = openai.OpenAI(base_url=trajectory["base_url"], api_key="x", max_retries=2)
    reply = client.chat.completions.create(**GOOD)
    assert reply.choices[0].message.content == "echo: hi"
    assert [r.header("x-stainless-retry-count") for r in upstream.requests] == ["0", "1"]
    document = state(server, trajectory)
    assert len(document["nodes"]) == 2 and len(document["nodes"][1]["calls"]) == 1
    assert [f["status"] for f in document["failures"]] == [503]
    assert document["retries"] == {"replayed": 0, "coalesced": 0}


def test_sdk_retries_after_a_client_timeout(make_server, upstream: ScriptedUpstream) -> None:
    """The first attempt's disconnect does not cancel the call: its retry gets that reply."""
    server = make_server()  # no --upstream-timeout: only the SDK gives up here
    trajectory = Control(server.url).create()
    upstream.fail_next("sleep", seconds=1.2)
    client = openai.OpenAI(base_url=trajectory["base_url"], api_key="x", max_retries=3, timeout=0.5)
    reply = client.chat.completions.create(**GOOD)
    assert reply.choices[0].message.content == "echo: hi"
    assert len(upstream.requests) == 1
    document = state(server, trajectory)
    calls = [c for node in document["nodes"] for c in node["calls"]]
    assert len(calls) == 1 and document["failures"] == []  # a harness that left is no failure
    assert calls[0]["harness_saw_end"] is False
    assert document["retries"]["replayed"] >= 1


def test_streams_are_not_replayed(server, control: Control, upstream: ScriptedUpstream) -> None:
    trajectory = control.create()
    body = {**GOOD, "stream": True}
    post(trajectory, json=body, headers={"x-stainless-retry-count": "0"})
    post(trajectory, json=body, headers={"x-stainless-retry-count": "1"})
    assert len(upstream.requests) == 2
    assert state(server, trajectory)["retries"]["replayed"] == 0


def test_finish_cancels_calls_in_flight(make_server, upstream: ScriptedUpstream) -> None:
    control = Control(make_server().url)
    trajectory = control.create()
    upstream.fail_next("sleep", seconds=2.0)
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append(post(trajectory))
        except httpx.HTTPError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=call)
    worker.start()
    upstream.wait_for_requests(1)
    result = control.finish(trajectory["id"]).json()
    worker.join()
    assert result["samples"] == [] and result["status"] == "finished"
    assert isinstance(outcome[0], httpx.HTTPError)  # the connection was dropped
    assert control.document(trajectory["id"]).json()["nodes"] == []
    assert post(trajectory).status_code == 410

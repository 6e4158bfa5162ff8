"""Token-mode calls that outlive their harness: retries that wait on a running stream get
keep-alives, then the original reply; a call committed after its harness left is marked."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest
from server_fixtures import Control, control, wait_for
from token_stream_fixtures import ANSWER, START, _engine_reset, engine, server

from skycap.mock.engine import ScriptedEngine

#: dialect: (path, streamed body, the keep-alive line, the line that ends the reply)
DIALECTS = {
    "chat": (
        "/chat/completions",
        {"model": "p", "messages": START, "stream": True},
        ": keep-alive",
        "data: [DONE]",
    ),
    "messages": (
        "/messages",
        {"model": "p", "max_tokens": 64, "messages": START, "stream": True},
        "event: ping",
        "event: message_stop",
    ),
    "responses": (
        "/responses",
        {"model": "p", "input": "find x", "stream": True},
        "event: keepalive",
        "event: response.completed",
    ),
}


def _calls(control: Control, trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = control.document(trajectory["id"]).json()["nodes"]
    return [call for node in nodes if node["author"] == "model" for call in node["calls"]]


def _text(dialect: str, lines: list[str]) -> str:
    """The reply's text, joined from the SSE data lines of `dialect`."""
    parts = []
    for line in lines:
        if not line.startswith("data: {"):
            continue
        event = orjson.loads(line[len("data: ") :])
        if dialect == "chat" and event.get("choices"):
            parts.append(event["choices"][0]["delta"].get("content") or "")
        elif dialect == "messages" and event["type"] == "content_block_delta":
            parts.append(event["delta"].get("text") or "")
        elif dialect == "responses" and event["type"] == "response.output_text.delta":
            parts.append(event["delta"])
    return "".join(parts)


def _leave_after_the_first_event(url: str, raw: bytes) -> None:
    """A harness that gives up on its stream (an idle timeout) after one event."""
    headers = {"content-type": "application/json", "x-stainless-retry-count": "0"}
    with httpx.stream("POST", url, content=raw, headers=headers, timeout=10) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                return


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_a_streamed_retry_waits_with_keepalives_then_gets_the_original(
    dialect: str, control: Control, engine: ScriptedEngine
) -> None:
    path, body, keepalive, end = DIALECTS[dialect]
    trajectory = control.create()
    url = trajectory["base_url"] + path
    raw = orjson.dumps(body)
    engine.queue(ANSWER)
    engine.hold_stream(before_chunk=3)  # the original runs on, held mid-reply
    generated = len(engine.generated)
    _leave_after_the_first_event(url, raw)
    headers = {"content-type": "application/json", "x-stainless-retry-count": "1"}
    lines: list[str] = []
    # Without keep-alives the retry would read nothing until the original ends: the read
    # timeout (far above the keep-alive interval) would fire first.
    with httpx.stream("POST", url, content=raw, headers=headers, timeout=5) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            lines.append(line)
            if lines.count(keepalive) == 3:
                engine.resume_stream()  # the original finishes only now
    assert lines.index(keepalive) < min(
        i for i, line in enumerate(lines) if line.startswith("data: {")
    )
    assert end in lines
    assert _text(dialect, lines) == ANSWER
    assert len(engine.generated) == generated + 1  # the retry never sampled again
    document = control.document(trajectory["id"]).json()
    assert document["retries"] == {"replayed": 1, "coalesced": 1}
    (call,) = _calls(control, trajectory)
    assert call["harness_saw_end"] is False  # the original's harness had left


def _sdk_on_a_held_stream(
    control: Control, engine: ScriptedEngine
) -> tuple[dict[str, Any], openai.OpenAI]:
    """A new trajectory whose next reply streams, then holds before its third chunk, and an
    openai client on it that does not retry on its own (the test sends the retry)."""
    trajectory = control.create()
    engine.queue(ANSWER)
    engine.hold_stream(before_chunk=3)
    client = openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0, timeout=5
    )
    return trajectory, client


def test_a_streamed_retry_through_the_sdk_gets_the_original_reply(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory, client = _sdk_on_a_held_stream(control, engine)
    first = client.chat.completions.create(model="p", messages=START, stream=True)
    next(iter(first))
    first.close()  # the harness gives up after one event; the SDK sends the same bytes again
    stream = client.chat.completions.create(
        model="p", messages=START, stream=True, extra_headers={"x-stainless-retry-count": "1"}
    )
    engine.resume_stream()  # the SDK had its answer's head while the original still ran
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert control.document(trajectory["id"]).json()["retries"]["coalesced"] == 1


def test_a_streamed_responses_retry_through_the_sdk_reads_past_the_keepalive_events(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory, client = _sdk_on_a_held_stream(control, engine)
    first = client.responses.create(model="p", input="find x", stream=True)
    next(iter(first))
    first.close()
    retry = client.responses.create(
        model="p", input="find x", stream=True, extra_headers={"x-stainless-retry-count": "1"}
    )
    events = iter(retry)
    assert next(events).type == "keepalive"  # sent while the original is held
    engine.resume_stream()
    rest = list(events)
    completed = [e for e in rest if e.type == "response.completed"]
    assert len(completed) == 1 and completed[0].response.output_text == ANSWER


def test_a_retry_whose_original_fails_runs_as_the_call_on_its_waiting_stream(
    control: Control, engine: ScriptedEngine
) -> None:
    path, body, keepalive, end = DIALECTS["messages"]
    trajectory = control.create()
    url = trajectory["base_url"] + path
    raw = orjson.dumps(body)
    engine.queue(ANSWER, ANSWER)
    engine.fail_next("stream_break")
    engine.hold_stream(before_chunk=3)
    generated = len(engine.generated)
    _leave_after_the_first_event(url, raw)
    headers = {"content-type": "application/json", "x-stainless-retry-count": "1"}
    lines: list[str] = []
    with httpx.stream("POST", url, content=raw, headers=headers, timeout=5) as response:
        for line in response.iter_lines():
            lines.append(line)
            if lines.count(keepalive) == 2:
                engine.resume_stream()  # the original's stream now breaks
    pings = [i for i, line in enumerate(lines) if line == keepalive]
    assert pings[0] == 0 and pings[1] < lines.index("event: message_start")
    assert end in lines and "event: error" not in lines
    assert _text("messages", lines) == ANSWER  # sampled once more, streamed as it came
    assert len(engine.generated) == generated + 2
    document = control.document(trajectory["id"]).json()
    assert len(document["failures"]) == 1 and "engine" in document["failures"][0]["error"]
    (call,) = _calls(control, trajectory)
    assert "harness_saw_end" not in call  # the retry's harness read it to its end
    assert document["retries"] == {"replayed": 0, "coalesced": 0}


def test_a_finish_while_a_retry_waits_ends_its_stream_with_an_error_event(
    control: Control, engine: ScriptedEngine
) -> None:
    path, body, keepalive, _ = DIALECTS["chat"]
    trajectory = control.create()
    url = trajectory["base_url"] + path
    raw = orjson.dumps(body)
    engine.queue(ANSWER)
    engine.hold_stream(before_chunk=3)
    _leave_after_the_first_event(url, raw)
    headers = {"content-type": "application/json", "x-stainless-retry-count": "1"}
    lines: list[str] = []
    with httpx.stream("POST", url, content=raw, headers=headers, timeout=5) as response:
        for line in response.iter_lines():
            lines.append(line)
            if line == keepalive and lines.count(keepalive) == 1:
                assert control.finish(trajectory["id"]).status_code == 200
    errors = [orjson.loads(line[6:]) for line in lines if line.startswith('data: {"error"')]
    assert len(errors) == 1 and "trajectory is" in errors[0]["error"]["message"]
    assert not any(line.startswith('data: {"id"') for line in lines)  # no reply after it


def test_a_stream_whose_harness_left_is_marked_and_one_read_to_its_end_is_not(
    control: Control, engine: ScriptedEngine
) -> None:
    path, body, _, _ = DIALECTS["messages"]
    left, stayed = control.create(), control.create()
    engine.queue(ANSWER)
    engine.hold_stream(before_chunk=3)
    _leave_after_the_first_event(left["base_url"] + path, orjson.dumps(body))
    engine.resume_stream()
    (call,) = wait_for(lambda: _calls(control, left), timeout=10, what="the stream to commit")
    assert call["harness_saw_end"] is False
    engine.queue(ANSWER)
    with httpx.stream("POST", stayed["base_url"] + path, json=body, timeout=10) as response:
        lines = list(response.iter_lines())
    assert _text("messages", lines) == ANSWER
    (call,) = _calls(control, stayed)
    assert "harness_saw_end" not in call


def test_a_call_whose_harness_timed_out_is_marked_and_replayed(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    url = f"{trajectory['base_url']}/chat/completions"
    raw = orjson.dumps({"model": "p", "messages": START})
    headers = {"content-type": "application/json"}
    engine.queue(ANSWER)
    engine.fail_next("hang")
    generated = len(engine.generated)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, content=raw, headers=headers, timeout=0.5)
    engine.release()
    (call,) = wait_for(lambda: _calls(control, trajectory), timeout=10, what="the commit")
    assert call["harness_saw_end"] is False
    retry = httpx.post(url, content=raw, headers={**headers, "x-stainless-retry-count": "1"})
    assert retry.status_code == 200 and retry.headers["content-type"] == "application/json"
    assert retry.json()["choices"][0]["message"]["content"] == ANSWER
    assert len(engine.generated) == generated + 1
    # A call answered while its harness waited is not marked.
    engine.queue(ANSWER)
    reply = httpx.post(
        url, json={"model": "p", "messages": [*START, {"role": "user", "content": "y"}]}
    )
    assert reply.status_code == 200
    assert "harness_saw_end" not in _calls(control, trajectory)[-1]

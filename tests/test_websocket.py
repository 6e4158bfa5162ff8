"""Responses calls over a WebSocket in text mode: the real openai SDK's `responses.connect()`
(and raw messages) on a trajectory's base URL, through skycap to the scripted upstream.

Each `response.create` is one call recording `transport: "websocket"`; a call continuing
the connection's newest response by `previous_response_id` reaches the upstream with the
whole input, as Codex's incremental turns must; `generate: false` is answered without a
call; errors come back as the API's `error` events and the connection goes on.
"""

# The server, its scripted upstream and the control client are test_responses_text's
# fixtures (a weather tool, then the answer), taken as arguments here.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import orjson
import pytest
import websockets
from server_fixtures import Control, ServerThread, wait_for
from test_responses_text import ANSWER, QUESTION, TOOLS, control, server, upstream  # noqa: F401

from skycap.mock.responses import ScriptedResponsesUpstream

END = ("response.completed", "response.incomplete", "response.failed", "error")


def socket_url(created: dict[str, Any]) -> str:
    return created["base_url"].replace("http://", "ws://", 1) + "/responses"


def calls_of(control: Control, trajectory_id: str) -> list[dict[str, Any]]:
    document = control.document(trajectory_id).json()
    return [call for node in document["nodes"] for call in node.get("calls") or ()]


async def until_end(connection: Any) -> Any:
    """The events of one response, up to its terminal event (returned)."""
    async for event in connection:
        if event.type in END:
            return event
    raise AssertionError("the connection closed before the response ended")


def test_sdk_tool_round_trip_is_one_path_with_the_whole_input_upstream(
    control: Control, upstream: ScriptedResponsesUpstream
) -> None:
    created = control.create()
    client = openai.AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"])
    first_input = [{"role": "user", "content": QUESTION}]

    async def converse() -> list[Any]:
        async with client.responses.connect() as connection:
            await connection.response.create(
                model="gpt-x", input=first_input, tools=TOOLS, store=False, generate=False
            )
            warm = await until_end(connection)
            await connection.response.create(
                model="gpt-x",
                input=[],
                tools=TOOLS,
                store=False,
                previous_response_id=warm.response.id,
            )
            called = await until_end(connection)
            (call,) = [item for item in called.response.output if item.type == "function_call"]
            output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
            await connection.response.create(
                model="gpt-x",
                input=[output],
                tools=TOOLS,
                store=False,
                previous_response_id=called.response.id,
            )
            answered = await until_end(connection)
            return [warm, called, answered]

    upstream.requests.clear()
    warm, called, answered = asyncio.run(converse())
    assert warm.type == called.type == answered.type == "response.completed"
    assert warm.response.output == []
    assert answered.response.output[-1].content[0].text == ANSWER
    # The warm-up sampled nothing: two calls upstream, each with the whole input, no id.
    bodies = [orjson.loads(request.body) for request in upstream.requests]
    assert len(bodies) == 2 and all("previous_response_id" not in b for b in bodies)
    assert all(b["stream"] is True and "type" not in b for b in bodies)
    assert [item.get("type", "message") for item in bodies[1]["input"]] == [
        "message",
        "reasoning",
        "function_call",
        "function_call_output",
    ]
    calls = calls_of(control, created["id"])
    assert [c["transport"] for c in calls] == ["websocket", "websocket"]
    assert [c["finish_reason"] for c in calls] == ["tool_calls", "stop"]
    assert calls[1]["response_id"] == answered.response.id
    finished = control.finish(created["id"]).json()
    assert len(finished["samples"]) == 1  # the continued call extends the first: one path


async def exchange(url: str, key: str, messages: list[bytes]) -> list[list[dict[str, Any]]]:
    """Send each raw message in turn; the events each one was answered with (none for a
    message that is no call, read up to the next one's answer)."""
    answers: list[list[dict[str, Any]]] = []
    headers = {"Authorization": f"Bearer {key}"}
    async with websockets.connect(url, additional_headers=headers) as socket:
        for message in messages:
            await socket.send(message)
            try:
                parsed = json.loads(message)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and parsed.get("type") != "response.create":
                continue
            events: list[dict[str, Any]] = []
            while not events or events[-1]["type"] not in END:
                events.append(json.loads(await socket.recv()))
            answers.append(events)
    return answers


def create(**body: Any) -> bytes:
    return json.dumps({"type": "response.create", "model": "gpt-x", **body}).encode()


def test_bad_messages_are_error_events_and_the_connection_goes_on(control: Control) -> None:
    created = control.create()
    question = [{"role": "user", "content": QUESTION}]
    messages = [
        b"not json",
        b"[1, 2]",
        json.dumps({"type": "response.cancel"}).encode(),  # no call: ignored
        create(input=42),
        create(input=question, tools=TOOLS),
    ]
    answers = asyncio.run(exchange(socket_url(created), created["api_key"], messages))
    not_json, not_object, bad_field, good = answers
    for events, words in ((not_json, "not JSON"), (not_object, "JSON object")):
        (event,) = events
        assert event["type"] == "error" and event["status"] == 400
        assert words in event["error"]["message"] and event["error"]["type"]
    (event,) = bad_field
    assert event["status"] == 400 and "input" in event["error"]["message"]
    assert good[-1]["type"] == "response.completed"
    assert [c["transport"] for c in calls_of(control, created["id"])] == ["websocket"]


def test_upstream_failure_is_an_error_event_with_its_status(
    control: Control, upstream: ScriptedResponsesUpstream
) -> None:
    created = control.create()
    upstream.fail_next("status", status=503)
    question = [{"role": "user", "content": QUESTION}]
    messages = [create(input=question), create(input=question)]
    failed, retried = asyncio.run(exchange(socket_url(created), created["api_key"], messages))
    (event,) = failed
    assert event["type"] == "error" and event["status"] == 503
    assert retried[-1]["type"] == "response.completed"
    document = control.document(created["id"]).json()
    assert document["failures"] and document["failures"][0]["status"] == 503


def test_the_handshake_is_gated_like_a_call(control: Control, server: ServerThread) -> None:
    created = control.create()
    missing = socket_url({"base_url": f"{server.url}/t/t-{'0' * 32}/v1"})
    with pytest.raises(websockets.InvalidStatus) as unknown:
        asyncio.run(exchange(missing, created["api_key"], []))
    assert unknown.value.response.status_code == 404
    # A Responses WebSocket that names no trajectory is not captured: 426, so Codex
    # falls back to HTTPS at once.
    uncaptured = server.url.replace("http://", "ws://", 1) + "/v1/responses"
    with pytest.raises(websockets.InvalidStatus) as upgrade:
        asyncio.run(exchange(uncaptured, created["api_key"], []))
    assert upgrade.value.response.status_code == 426
    assert b"websocket_not_supported" in upgrade.value.response.body


def test_a_harness_that_leaves_mid_stream_still_gets_its_call_committed(
    control: Control, upstream: ScriptedResponsesUpstream
) -> None:
    created = control.create()
    upstream.chunk_delay = 0.05
    question = [{"role": "user", "content": QUESTION}]

    async def leave() -> None:
        headers = {"Authorization": f"Bearer {created['api_key']}"}
        async with websockets.connect(socket_url(created), additional_headers=headers) as socket:
            await socket.send(create(input=question, tools=TOOLS))
            first = json.loads(await socket.recv())
            assert first["type"] == "response.created"

    asyncio.run(leave())
    calls = wait_for(lambda: calls_of(control, created["id"]), what="the commit")
    assert calls[0]["transport"] == "websocket"
    assert calls[0]["harness_saw_end"] is False


def test_a_message_after_the_trajectory_ended_is_a_410_error_event(control: Control) -> None:
    created = control.create()
    question = [{"role": "user", "content": QUESTION}]

    async def after_finish() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        headers = {"Authorization": f"Bearer {created['api_key']}"}
        async with websockets.connect(socket_url(created), additional_headers=headers) as socket:
            answers = []
            for finish in (False, True):
                if finish:
                    await asyncio.to_thread(control.finish, created["id"])
                await socket.send(create(input=question))
                events = [json.loads(await socket.recv())]
                while events[-1]["type"] not in END:
                    events.append(json.loads(await socket.recv()))
                answers.append(events)
            return answers[0], answers[1]

    answered, refused = asyncio.run(after_finish())
    assert answered[-1]["type"] == "response.completed"
    (event,) = refused
    assert event["type"] == "error" and event["status"] == 410
    assert event["error"]["code"] == "trajectory_closed"

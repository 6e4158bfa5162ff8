"""Tests for the scripted Responses upstream, driven by the unchanged openai SDK."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from skycap.dialects import StreamError
from skycap.dialects.responses_stream import ResponsesAssembler
from skycap.mock.responses import ScriptedResponsesUpstream
from skycap.mock.upstream import Reply

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CALL = {"id": "call_w", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HTTP = httpx.Client(timeout=5)


@pytest.fixture
def upstream() -> Iterator[ScriptedResponsesUpstream]:
    with ScriptedResponsesUpstream() as server:
        yield server


def sdk(upstream: ScriptedResponsesUpstream) -> openai.OpenAI:
    return openai.OpenAI(api_key="sk-harness", base_url=upstream.base_url, max_retries=0)


def raw_stream(upstream: ScriptedResponsesUpstream, body: dict[str, Any]) -> list[bytes]:
    url = f"{upstream.base_url}/responses"
    with HTTP.stream("POST", url, json=body | {"stream": True}) as response:
        assert response.headers["content-type"] == "text/event-stream"
        return list(response.iter_raw())


def events_of(chunks: list[bytes]) -> list[dict[str, Any]]:
    body = b"".join(chunks)
    return [orjson.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: ")]


def test_sdk_create_reads_echo_and_usage(upstream: ScriptedResponsesUpstream) -> None:
    response = sdk(upstream).responses.create(model="m", input="hello there")
    assert response.output_text == "echo: hello there"
    assert response.status == "completed"
    assert response.usage is not None and response.usage.input_tokens > 0
    assert orjson.loads(upstream.requests[0].body)["input"] == "hello there"
    assert upstream.stored[response.id]["output"][0]["type"] == "message"


def test_sdk_stream_helper_folds_reasoning_and_tool_calls(
    upstream: ScriptedResponsesUpstream,
) -> None:
    upstream.script = [Reply(reasoning_content="I should look it up", tool_calls=[CALL])]
    with sdk(upstream).responses.stream(model="m", input="weather?", tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds
    assert kinds.count("response.function_call_arguments.delta") > 1  # streamed in pieces
    reasoning, call = final.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content == "mock-encrypted-1"
    assert call.type == "function_call" and call.call_id == "call_w"
    assert call.arguments == '{"city": "Paris"}'


def test_sequence_numbers_count_up_and_the_stream_assembles(
    upstream: ScriptedResponsesUpstream,
) -> None:
    upstream.script = [Reply(content="a fairly long answer in pieces", reasoning_content="hm")]
    chunks = raw_stream(upstream, {"model": "m", "input": "x"})
    assert len(chunks) > 5  # one write per event
    events = events_of(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assembler = ResponsesAssembler()
    for chunk in chunks:
        assembler.feed(chunk)
    message, reason = assembler.result()
    assert message["content"] == "a fairly long answer in pieces"
    assert message["reasoning_content"] == "hm"
    assert reason == "stop" and assembler.usage is not None and assembler.usage["output_tokens"] > 0


def test_length_stop_is_incomplete(upstream: ScriptedResponsesUpstream) -> None:
    upstream.script = [Reply(content="cut", finish_reason="length")]
    response = sdk(upstream).responses.create(model="m", input="x", max_output_tokens=1)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_must_be_stored(upstream: ScriptedResponsesUpstream) -> None:
    client = sdk(upstream)
    first = client.responses.create(model="m", input="one")
    second = client.responses.create(model="m", input="two", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    assert caught.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(first.id).output_text == "echo: one"
    unstored = client.responses.create(model="m", input="gone", store=False)
    assert unstored.id not in upstream.stored
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


def test_fault_status_then_normal(upstream: ScriptedResponsesUpstream) -> None:
    upstream.fail_next("status", status=503)
    with pytest.raises(openai.InternalServerError):
        sdk(upstream).responses.create(model="m", input="x")
    assert sdk(upstream).responses.create(model="m", input="x").output_text == "echo: x"


def test_fault_garbage_and_no_terminal_event(upstream: ScriptedResponsesUpstream) -> None:
    upstream.fail_next("garbage")
    assembler = ResponsesAssembler()
    for chunk in raw_stream(upstream, {"model": "m", "input": "x"}):
        assembler.feed(chunk)
    with pytest.raises(StreamError, match="not JSON"):
        assembler.result()
    upstream.fail_next("no_choices")
    assembler = ResponsesAssembler()
    for chunk in raw_stream(upstream, {"model": "m", "input": "x"}):
        assembler.feed(chunk)
    assert not assembler.finish_seen
    with pytest.raises(StreamError, match="no response.completed"):
        assembler.result()


def test_fault_break_stream_cuts_the_events(upstream: ScriptedResponsesUpstream) -> None:
    upstream.fail_next("break_stream")
    received: list[bytes] = []
    with pytest.raises(httpx.RemoteProtocolError):
        with HTTP.stream(
            "POST", f"{upstream.base_url}/responses", json={"input": "x", "stream": True}
        ) as response:
            received.extend(response.iter_raw())
    assert events_of(received)[0]["type"] == "response.created"
    assert all(e["type"] != "response.completed" for e in events_of(received))
    upstream.fail_next("break_stream")
    with pytest.raises(httpx.RemoteProtocolError):
        HTTP.post(f"{upstream.base_url}/responses", json={"input": "x"})


def test_fault_hang_is_released_by_stop() -> None:
    upstream = ScriptedResponsesUpstream()
    upstream.start()
    upstream.fail_next("hang")
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            HTTP.post(f"{upstream.base_url}/responses", json={"input": "x"})
        except httpx.HTTPError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    upstream.wait_for_requests(1)
    assert caller.is_alive()
    upstream.stop()
    caller.join(timeout=5)
    assert not caller.is_alive() and isinstance(outcome[0], httpx.RemoteProtocolError)

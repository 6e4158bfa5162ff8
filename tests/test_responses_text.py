"""Text mode over the Responses API: the real openai SDK and Agents SDK through skycap to the
scripted Responses upstream, JSON and streamed, with faults."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from server_fixtures import Control, ServerThread, wait_for

from skycap.mock.responses import ScriptedResponsesUpstream
from skycap.mock.upstream import Reply
from skycap.server.options import ServerOptions

os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"  # never export traces to OpenAI

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
QUESTION = "What is the weather in Paris?"
ANSWER = "It is sunny in Paris."
CALL = {"id": "call_w1", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}


def weather(body: dict[str, Any]) -> Reply:
    """Reasoning and a tool call until the input holds a tool result, then the answer."""
    if "function_call_output" in orjson.dumps(body.get("input")).decode():
        return Reply(reasoning_content="The tool answered.", content=ANSWER)
    return Reply(reasoning_content="I should look it up.", tool_calls=[CALL])


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedResponsesUpstream]:
    with ScriptedResponsesUpstream(weather) as mock:
        yield mock


@pytest.fixture(scope="module")
def server(upstream: ScriptedResponsesUpstream) -> Iterator[ServerThread]:
    thread = ServerThread(ServerOptions(upstream.base_url, upstream_timeout=2.0))
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture
def control(server: ServerThread, upstream: ScriptedResponsesUpstream) -> Iterator[Control]:
    upstream.script = weather
    upstream.clear_faults()
    with Control(server.url) as client:
        yield client


def sdk(trajectory: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )


def items(response: Any) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in response.output]


def tool_output(response: Any) -> dict[str, Any]:
    (call,) = [item for item in response.output if item.type == "function_call"]
    return {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}


def calls_of(control: Control, trajectory_id: str) -> list[dict[str, Any]]:
    document = control.document(trajectory_id).json()
    return [call for node in document["nodes"] for call in node["calls"]]


def test_json_tool_round_trip_is_one_path_of_canonical_messages(
    control: Control, upstream: ScriptedResponsesUpstream
) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    first = client.responses.create(
        model="policy", instructions="Be brief.", input=QUESTION, tools=TOOLS, store=False
    )
    history = [{"role": "user", "content": QUESTION}, *items(first), tool_output(first)]
    second = client.responses.create(
        model="policy", instructions="Be brief.", input=history, tools=TOOLS, store=False
    )
    assert second.output_text == ANSWER
    forwarded = orjson.loads(upstream.requests[-1].body)
    assert forwarded["input"][1]["encrypted_content"] == "mock-encrypted-1"  # body unchanged
    assert upstream.requests[-1].header("authorization") is None  # the harness key stays

    calls = calls_of(control, trajectory["id"])
    assert [c["dialect"] for c in calls] == ["responses", "responses"]
    assert [c["response_id"] for c in calls] == [first.id, second.id]
    assert calls[0]["usage"]["input_tokens"] > 0  # recorded as returned
    assert [c["finish_reason"] for c in calls] == ["tool_calls", "stop"]
    (sample,) = control.finish(trajectory["id"]).json()["samples"]
    system, user, turn, result, reply = sample["messages"]
    assert system == {"role": "system", "content": "Be brief."}
    assert user == {"role": "user", "content": QUESTION}
    assert turn["tool_calls"][0]["id"] == "call_w1"
    assert turn["reasoning_content"] == "I should look it up."
    assert turn["reasoning_items"][0]["encrypted_content"] == "mock-encrypted-1"
    assert result == {"role": "tool", "tool_call_id": "call_w1", "content": "sunny"}
    assert reply["content"] == ANSWER


def test_tool_choice_is_forwarded_as_sent_and_recorded_canonically(
    control: Control, upstream: ScriptedResponsesUpstream
) -> None:
    trajectory = control.create()
    choice = {"type": "function", "name": "get_weather"}
    response = sdk(trajectory).responses.create(
        model="policy", input=QUESTION, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False
    )
    assert response.parallel_tool_calls is False  # the upstream's answer, relayed
    forwarded = orjson.loads(upstream.requests[-1].body)
    assert forwarded["tool_choice"] == choice and forwarded["parallel_tool_calls"] is False
    (call,) = calls_of(control, trajectory["id"])
    assert call["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert call["parallel_tool_calls"] is False


def test_streams_relay_every_event_and_previous_response_id_places_the_call(
    control: Control, upstream: ScriptedResponsesUpstream
) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    with client.responses.stream(model="policy", input=QUESTION, tools=TOOLS) as stream:
        numbers = [event.sequence_number for event in stream]
        first = stream.get_final_response()
    assert numbers == list(range(len(numbers)))  # relayed as sent, none lost or added
    with client.responses.stream(
        model="policy", input=[tool_output(first)], tools=TOOLS, previous_response_id=first.id
    ) as stream:
        second = stream.get_final_response()
    assert second.output_text == ANSWER
    assert orjson.loads(upstream.requests[-1].body)["previous_response_id"] == first.id
    calls = calls_of(control, trajectory["id"])
    assert calls[1]["previous_response_id"] == first.id
    (sample,) = control.finish(trajectory["id"]).json()["samples"]
    assert [m["role"] for m in sample["messages"]] == ["user", "assistant", "tool", "assistant"]


def test_upstream_404_for_an_unknown_previous_response_id_reaches_the_harness(
    control: Control,
) -> None:
    trajectory = control.create()
    with pytest.raises(openai.NotFoundError) as caught:
        sdk(trajectory).responses.create(model="policy", input="x", previous_response_id="resp_no")
    assert caught.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("input_", "param", "words"),
    [
        ([{"role": 7, "content": "x"}], "input[0].role", "must be a string"),
        (
            [{"type": "function_call_output", "call_id": "call_x", "output": "1"}],
            "input",
            "matches no function_call",
        ),
        (
            [{"role": "user", "content": [{"type": "input_text"}]}],
            "input[0].content[0]",
            "no string text",
        ),
    ],
)
def test_bad_input_is_refused_before_the_upstream(
    control: Control, upstream: ScriptedResponsesUpstream, input_: Any, param: str, words: str
) -> None:
    trajectory = control.create()
    before = len(upstream.requests)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(trajectory).responses.create(model="policy", input=input_)
    assert words in caught.value.body["message"] and caught.value.body["param"] == param
    assert len(upstream.requests) == before


def test_images_are_forwarded_and_recorded_in_text_mode(control: Control) -> None:
    trajectory = control.create()
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}
    content = [{"type": "input_text", "text": "What is this?"}, image]
    sdk(trajectory).responses.create(model="policy", input=[{"role": "user", "content": content}])
    (sample,) = control.finish(trajectory["id"]).json()["samples"]
    assert sample["messages"][0]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"},
    }


def test_an_ended_trajectory_is_a_410(control: Control) -> None:
    trajectory = control.create()
    control.finish(trajectory["id"])
    with pytest.raises(openai.APIStatusError) as caught:
        sdk(trajectory).responses.create(model="policy", input="x")
    assert caught.value.status_code == 410 and caught.value.body["code"] == "trajectory_closed"


def test_a_stream_cut_mid_way_fails_the_harness_stream_and_is_not_recorded(
    control: Control, upstream: ScriptedResponsesUpstream
) -> None:
    trajectory = control.create()
    upstream.fail_next("break_stream")
    with sdk(trajectory).responses.stream(model="p", input="x") as stream:
        events = list(stream)  # the SDK hands the failure on as an event, as OpenAI sends it
    # The stream ends with response.failed, numbered after the last event the harness got.
    assert events[-1].type == "response.failed"
    assert events[-1].sequence_number == events[-2].sequence_number + 1
    assert events[-1].response.status == "failed"
    assert "upstream stream interrupted" in events[-1].response.error.message
    document = wait_for(
        lambda: (d := control.document(trajectory["id"]).json())["failures"] and d,
        what="the failure",
    )
    assert document["failures"][0]["error"].startswith("upstream stream interrupted: ")
    assert calls_of(control, trajectory["id"]) == []
    assert sdk(trajectory).responses.create(model="p", input="again").status == "completed"


async def test_agents_sdk_default_model_runs_multi_turn_streamed_and_chained(
    control: Control,
) -> None:
    from agents import Agent, Runner, function_tool, set_default_openai_client

    @function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return f"sunny in {city}"

    for mode in ("run", "streamed", "chained"):
        trajectory = control.create()
        client = openai.AsyncOpenAI(
            base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
        )
        set_default_openai_client(client, use_for_tracing=False)
        agent = Agent(name="weather", instructions="Be brief.", tools=[get_weather])
        if mode == "streamed":
            result = Runner.run_streamed(agent, QUESTION)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, QUESTION, auto_previous_response_id=mode == "chained")
        assert result.final_output == ANSWER
        if mode == "run":
            follow_up = [*result.to_input_list(), {"role": "user", "content": "And tomorrow?"}]
            await Runner.run(agent, follow_up)
        calls = calls_of(control, trajectory["id"])
        assert len(calls) == (3 if mode == "run" else 2) and all(
            c["dialect"] == "responses" for c in calls
        )
        finished = control.finish(trajectory["id"]).json()
        assert len(finished["samples"]) == 1, mode
        await client.close()


def test_remote_compaction_is_forwarded_and_recorded_as_a_call(
    control: Control, upstream: ScriptedResponsesUpstream
) -> None:
    """`POST /v1/responses/compact` goes to the upstream's compact route as sent; the call
    records the compacted history verbatim as its reply."""
    trajectory = control.create()
    client = sdk(trajectory)
    first = client.responses.create(model="policy", input=QUESTION, tools=TOOLS, store=False)
    history = [{"role": "user", "content": QUESTION}, *items(first), tool_output(first)]
    body = {"model": "policy", "input": history, "tools": TOOLS}
    compacted = httpx.post(
        f"{trajectory['base_url']}/responses/compact",
        json=body,
        headers={"authorization": f"Bearer {trajectory['api_key']}"},
    )
    assert compacted.status_code == 200, compacted.text
    output = compacted.json()["output"]
    assert [item.get("type", "message") for item in output] == ["message", "compaction"]
    forwarded = upstream.requests[-1]
    assert forwarded.path == "/v1/responses/compact" and orjson.loads(forwarded.body) == body

    calls = calls_of(control, trajectory["id"])
    assert [c["dialect"] for c in calls] == ["responses", "responses"]
    assert calls[1]["finish_reason"] == "stop" and "response_id" not in calls[1]
    document = control.document(trajectory["id"]).json()
    reply = [node for node in document["nodes"] if node.get("calls")][-1]
    assert reply["message"]["content"] == [
        {"type": "opaque", "dialect": "responses", "value": {"output": output}}
    ]
    # It extends the turn it compacts: one path; the next call's input starts anew.
    (sample,) = control.finish(trajectory["id"]).json()["samples"]
    assert sample["messages"][-1] == reply["message"]

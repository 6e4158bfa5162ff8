"""Token mode over the Responses API: the real openai SDK and Agents SDK to a scripted engine."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_fixtures import Control, ServerThread, TextScript

from skycap.cli.main import main as skycap_main
from skycap.loader import load
from skycap.mock.engine import ScriptedEngine
from skycap.mock.engine_wire import scripted_logprob
from skycap.server.options import ServerOptions

os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"  # never export traces to OpenAI

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
QUESTION = "What is the weather in Paris?"
ANSWER = "It is sunny in Paris."


class Script(TextScript):
    """Thinking and a get_weather call until the prompt holds a tool result, then an answer."""

    def text(self, prompt: list[int]) -> str:
        last_user = self.tokenizer.decode(prompt).rpartition("<|im_start|>user")[2]
        if "<tool_response>" in last_user:
            return f"<think>\nThe tool answered.\n</think>\n\n{ANSWER}"
        call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
        return f"<think>\nI should look it up.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"


@pytest.fixture(scope="module")
def script(qwen3_tokenizer: Any) -> Script:
    return Script(qwen3_tokenizer)


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer: Any, script: Script) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer, script=script, model="policy") as scripted:
        yield scripted


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses-records")


@pytest.fixture(scope="module")
def server(engine: ScriptedEngine, qwen3_renderer: Any, records: Path) -> Iterator[ServerThread]:
    options = ServerOptions(
        engine.url, mode="tokens", renderer=qwen3_renderer, model="policy", record_dir=records
    )
    thread = ServerThread(options)
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture
def control(server: ServerThread) -> Iterator[Control]:
    with Control(server.url) as client:
        yield client


def sdk(trajectory: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )


def items(response: Any) -> list[dict[str, Any]]:
    """A response's output items as a client sends them back."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def tool_output(response: Any, output: str = "sunny, 21 C") -> dict[str, Any]:
    (call,) = [item for item in response.output if item.type == "function_call"]
    return {"type": "function_call_output", "call_id": call.call_id, "output": output}


def calls_of(control: Control, trajectory_id: str) -> list[dict[str, Any]]:
    document = control.document(trajectory_id).json()
    return [call for node in document["nodes"] for call in node["calls"]]


def check_exact(
    sample: dict[str, Any], engine: ScriptedEngine, trajectory_id: str, script: Script
) -> None:
    """The sample's tokens are the engine's last prompt and completion; every completion
    is where the engine produced it, trained on with the engine's logprobs."""
    prompts = [
        r.body["token_ids"]
        for r in engine.requests
        if r.method == "POST" and r.headers.get("X-Session-ID") == trajectory_id
    ]
    completions = [script.completion(p) for p in prompts]
    input_ids = sample["input_ids"]
    assert input_ids == prompts[-1] + completions[-1]
    for prompt, completion in zip(prompts, completions, strict=True):
        start = len(prompt)
        assert input_ids[start : start + len(completion)] == completion
        assert sample["loss_mask"][start : start + len(completion)] == [1] * len(completion)
        assert sample["logprobs"][start] == scripted_logprob(completion[0], start)
    assert sum(sample["loss_mask"]) == sum(len(c) for c in completions)


def round_trip(control: Control, engine: ScriptedEngine, script: Script) -> str:
    """A tool round trip with the full input each call; the trajectory's id, finished."""
    trajectory = control.create()
    client = sdk(trajectory)
    first = client.responses.create(model="policy", input=QUESTION, tools=TOOLS, store=False)
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    reasoning, call = first.output
    assert reasoning.encrypted_content.startswith("skycap.r1.")
    assert reasoning.content[0].text == "I should look it up."
    assert call.name == "get_weather" and call.arguments == '{"city":"Paris"}'
    assert first.status == "completed" and first.usage.output_tokens_details.reasoning_tokens > 0
    history = [{"role": "user", "content": QUESTION}, *items(first), tool_output(first)]
    second = client.responses.create(model="policy", input=history, tools=TOOLS, store=False)
    assert second.output_text == ANSWER

    calls = calls_of(control, trajectory["id"])
    assert [c["dialect"] for c in calls] == ["responses", "responses"]
    assert [c["bridged"] for c in calls] == [None, True]
    assert [c["response_id"] for c in calls] == [first.id, second.id]
    finished = control.finish(trajectory["id"]).json()
    assert finished["unbridged_calls"] == 0
    (sample,) = finished["samples"]
    check_exact(sample, engine, trajectory["id"], script)
    return trajectory["id"]


def test_tool_round_trip_with_full_input_is_one_bridged_path(
    control: Control, engine: ScriptedEngine, script: Script
) -> None:
    round_trip(control, engine, script)


def test_records_of_responses_calls_load_check_and_validate(
    control: Control, engine: ScriptedEngine, script: Script, records: Path, capsys: Any
) -> None:
    trajectory_id = round_trip(control, engine, script)
    loaded = load(str(records), trajectory_id)
    calls = [call for node in loaded.trajectory.graph for call in node.calls]
    assert [c["dialect"] for c in calls] == ["responses", "responses"]
    assert len(loaded.samples()) == 1
    assert skycap_main(["check", str(records), trajectory_id]) == 0
    assert skycap_main(["validate", str(records)]) == 0
    out = capsys.readouterr().out
    assert f"{trajectory_id}  finished  linear" in out and "0 with problems" in out


def test_a_client_that_drops_reasoning_text_stays_on_the_path(control: Control) -> None:
    """OpenAI's own reasoning items come back without their text: encrypted_content holds it."""
    trajectory = control.create()
    client = sdk(trajectory)
    first = client.responses.create(model="policy", input=QUESTION, tools=TOOLS, store=False)
    replayed = items(first)
    replayed[0].pop("content")
    history = [{"role": "user", "content": QUESTION}, *replayed, tool_output(first)]
    client.responses.create(model="policy", input=history, tools=TOOLS, store=False)
    assert [c["bridged"] for c in calls_of(control, trajectory["id"])] == [None, True]
    assert len(control.finish(trajectory["id"]).json()["samples"]) == 1


def test_streamed_round_trip_and_previous_response_id_give_the_same_chain(
    control: Control, engine: ScriptedEngine, script: Script
) -> None:
    chained, full = control.create(), control.create()
    client = sdk(chained)
    with client.responses.stream(model="policy", input=QUESTION, tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    with client.responses.stream(
        model="policy", input=[tool_output(first)], tools=TOOLS, previous_response_id=first.id
    ) as stream:
        second = stream.get_final_response()
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output[1].call_id == first.output[1].call_id

    other = sdk(full)
    one = other.responses.create(model="policy", input=QUESTION, tools=TOOLS, store=False)
    history = [{"role": "user", "content": QUESTION}, *items(one), tool_output(one)]
    other.responses.create(model="policy", input=history, tools=TOOLS, store=False)

    calls = calls_of(control, chained["id"])
    assert [c["bridged"] for c in calls] == [None, True]
    assert calls[1]["previous_response_id"] == first.id
    (by_id,) = control.finish(chained["id"]).json()["samples"]
    (by_input,) = control.finish(full["id"]).json()["samples"]
    assert by_id["input_ids"] == by_input["input_ids"]
    assert [m["role"] for m in by_id["messages"]] == ["user", "assistant", "tool", "assistant"]
    check_exact(by_id, engine, chained["id"], script)


def test_unknown_previous_response_id_is_a_404_naming_the_param(control: Control) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="policy", input="hi", previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id"
    assert "resp_nope" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


@pytest.mark.parametrize(
    ("input_", "param", "words"),
    [
        (
            [{"type": "web_search_call", "id": "ws_1"}],
            None,
            "input[0] has type 'web_search_call', which token mode cannot render",
        ),
        (
            [{"type": "function_call_output", "call_id": "call_x", "output": "1"}],
            "input",
            "matches no function_call",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}],
                }
            ],
            None,
            "token mode renders text only",
        ),
    ],
)
def test_bad_input_is_a_responses_shaped_400(
    control: Control, input_: Any, param: str | None, words: str
) -> None:
    trajectory = control.create()
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(trajectory).responses.create(model="policy", input=input_)
    assert words in caught.value.body["message"]
    assert caught.value.body["param"] == param
    assert caught.value.body["type"] == "invalid_request_error"


def test_tools_a_template_cannot_express_are_omitted_and_recorded(
    control: Control, engine: ScriptedEngine, qwen3_tokenizer: Any
) -> None:
    trajectory = control.create()
    tools = [
        *TOOLS,
        {"type": "web_search"},
        {"type": "custom", "name": "apply_patch", "description": "Patch files."},
    ]
    sdk(trajectory).responses.create(model="policy", input=QUESTION, tools=tools)
    (call,) = calls_of(control, trajectory["id"])
    assert call["omitted_tools"] == ["web_search"]
    document = control.document(trajectory["id"]).json()
    chat_tool = {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}
    rendered = document["tools"][call["tools"]]  # what the template rendered
    assert rendered[0] == chat_tool
    assert rendered[1]["function"]["name"] == "apply_patch"  # a custom tool: one `input`
    assert list(rendered[1]["function"]["parameters"]["properties"]) == ["input"]
    prompt = qwen3_tokenizer.decode(engine.requests[-1].body["token_ids"])
    assert "get_weather" in prompt and "apply_patch" in prompt and "web_search" not in prompt


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("choice", "recorded"),
    [
        ({"type": "function", "name": "get_weather"}, NAMED),
        ("required", "required"),
        (
            {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": "get_weather"}],
            },
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [NAMED]}},
        ),
    ],
)
def test_tool_choice_and_parallel_tool_calls_are_echoed_and_recorded(
    control: Control, choice: Any, recorded: Any
) -> None:
    trajectory = control.create()
    response = sdk(trajectory).responses.create(
        model="policy", input=QUESTION, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False
    )
    echoed = response.tool_choice
    assert (echoed if isinstance(echoed, str) else echoed.model_dump(exclude_none=True)) == choice
    assert response.parallel_tool_calls is False
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    (call,) = calls_of(control, trajectory["id"])
    assert call["tool_choice"] == recorded and call["parallel_tool_calls"] is False
    assert call["finish_reason"] == "tool_calls" and "omitted_tools" not in call


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(
    control: Control, engine: ScriptedEngine, qwen3_tokenizer: Any
) -> None:
    trajectory = control.create()
    response = sdk(trajectory).responses.create(
        model="policy", input=QUESTION, tools=TOOLS, tool_choice="none"
    )
    assert response.tool_choice == "none" and response.parallel_tool_calls is True
    prompt = qwen3_tokenizer.decode(engine.requests[-1].body["token_ids"])
    assert "<tools>" not in prompt and "get_weather" not in prompt
    (call,) = calls_of(control, trajectory["id"])
    assert call["tool_choice"] == "none" and call["omitted_tools"] == ["get_weather"]
    assert "parallel_tool_calls" not in call
    assert call["tools"] is None  # what the template rendered: no tools
    # Not enforced (the scripted model calls the tool regardless): what was sampled is answered.
    assert [item.type for item in response.output] == ["reasoning", "function_call"]


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ({"type": "function"}, "tool_choice.name"),
        ("sometimes", "tool_choice"),
        ({"type": "allowed_tools", "mode": "any", "tools": []}, "tool_choice.mode"),
    ],
)
def test_a_bad_tool_choice_is_a_responses_shaped_400(
    control: Control, choice: Any, param: str
) -> None:
    trajectory = control.create()
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(trajectory).responses.create(
            model="policy", input=QUESTION, tools=TOOLS, tool_choice=choice
        )
    assert caught.value.body["param"] == param and "tool_choice" in caught.value.body["message"]
    assert calls_of(control, trajectory["id"]) == []


def test_length_stop_is_incomplete_and_ended_trajectories_refuse(control: Control) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    cut = client.responses.create(model="policy", input=QUESTION, max_output_tokens=3)
    assert cut.status == "incomplete"
    assert (
        cut.incomplete_details is not None and cut.incomplete_details.reason == "max_output_tokens"
    )
    (call,) = calls_of(control, trajectory["id"])
    assert call["finish_reason"] == "length" and call["sampling"]["max_tokens"] == 3
    control.finish(trajectory["id"])
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(model="policy", input="again")
    assert caught.value.status_code == 410
    assert caught.value.body["code"] == "trajectory_closed"


def test_compact_is_refused_clearly(control: Control) -> None:
    trajectory = control.create()
    response = httpx.post(
        f"{trajectory['base_url']}/responses/compact",
        json={"model": "policy", "input": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {trajectory['api_key']}"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert "compact" in error["message"] and error["param"] is None
    assert "base URL" in error["message"] and "/t/{id}/v1" in error["message"]
    assert not calls_of(control, trajectory["id"])


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
        follow_up = [*result.to_input_list(), {"role": "user", "content": "And tomorrow?"}]
        if mode == "run":
            await Runner.run(agent, follow_up)
        calls = calls_of(control, trajectory["id"])
        assert all(c["dialect"] == "responses" for c in calls)
        assert [c["bridged"] for c in calls] == [None] + [True] * (len(calls) - 1), mode
        finished = control.finish(trajectory["id"]).json()
        assert len(finished["samples"]) == 1, mode
        await client.close()


def test_websocket_round_trip_continued_by_id_is_one_bridged_path(
    control: Control, engine: ScriptedEngine, script: Script
) -> None:
    """Codex's WebSocket turns: a warm-up, then each call continues the connection's newest
    response with only the new input; skycap renders the whole history each time."""
    trajectory = control.create()
    client = openai.AsyncOpenAI(base_url=trajectory["base_url"], api_key=trajectory["api_key"])

    async def until_end(connection: Any) -> Any:
        async for event in connection:
            if event.type in ("response.completed", "response.failed", "error"):
                return event
        raise AssertionError("the connection closed before the response ended")

    async def converse() -> tuple[Any, Any]:
        async with client.responses.connect() as connection:
            question = [{"role": "user", "content": QUESTION}]
            await connection.response.create(
                model="policy", input=question, tools=TOOLS, store=False, generate=False
            )
            warm = await until_end(connection)
            await connection.response.create(
                model="policy", input=[], tools=TOOLS, previous_response_id=warm.response.id
            )
            first = await until_end(connection)
            await connection.response.create(
                model="policy",
                input=[tool_output(first.response)],
                tools=TOOLS,
                previous_response_id=first.response.id,
            )
            return first, await until_end(connection)

    first, second = asyncio.run(converse())
    assert first.type == second.type == "response.completed"
    assert second.response.output[-1].content[0].text == ANSWER
    calls = calls_of(control, trajectory["id"])
    assert [c["transport"] for c in calls] == ["websocket", "websocket"]
    assert [c["bridged"] for c in calls] == [None, True]
    (sample,) = control.finish(trajectory["id"]).json()["samples"]
    check_exact(sample, engine, trajectory["id"], script)

"""Anthropic Messages in token mode: the anthropic SDK through skycap to a scripted engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from server_fixtures import Control, ServerThread, TextScript, anthropic_sdk, replayed_message

from skycap.mock.engine import ScriptedEngine
from skycap.server.options import ServerOptions
from skycap.tokens.library_renderer import LibraryRenderer

TOOLS = [
    {
        "name": "search",
        "description": "Search.",
        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
    }
]
TURNS = 3


class Script(TextScript):
    """Thinking and a tool call until the prompt holds TURNS tool results, then an answer."""

    def text(self, prompt: list[int]) -> str:
        done = prompt.count(self.tool_response)
        if done < TURNS:
            args = json.dumps({"query": f"step {done}"})
            return (
                f"<think>\nStep {done}: search.\n</think>\n\nSearching.\n"
                f'<tool_call>\n{{"name": "search", "arguments": {args}}}\n</tool_call>'
            )
        return f"<think>\nI have {done} results.\n</think>\n\nThe answer is 42."


@pytest.fixture(scope="module")
def script(qwen3_tokenizer: Any) -> Script:
    return Script(qwen3_tokenizer)


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer: Any, script: Script) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer, script=script, model="policy") as scripted:
        yield scripted


@pytest.fixture(scope="module")
def server(engine: ScriptedEngine, qwen3_renderer: LibraryRenderer) -> Iterator[ServerThread]:
    options = ServerOptions(engine.url, mode="tokens", renderer=qwen3_renderer, model="policy")
    with ServerThread(options) as server:
        yield server


@pytest.fixture
def control(server: ServerThread) -> Iterator[Control]:
    with Control(server.url) as client:
        yield client


def results_for(message: Any) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": "42", "cache_control": None}
            for b in message.content
            if b.type == "tool_use"
        ],
    }


START = [{"role": "user", "content": [{"type": "text", "text": "find x"}]}]


def check_one_bridged_path(
    control: Control, engine: ScriptedEngine, script: Script, created: dict[str, Any]
) -> None:
    """Every call after the first bridged, one sample, its tokens exactly the engine's."""
    document = control.document(created["id"]).json()
    calls = [c for n in document["nodes"] for c in n["calls"]]
    assert [c["bridged"] for c in calls] == [None] + [True] * TURNS
    assert {c["dialect"] for c in calls} == {"messages"}
    finished = control.finish(created["id"]).json()
    assert finished["unbridged_calls"] == 0 and finished["calls"] == TURNS + 1
    (sample,) = finished["samples"]
    prompts = [
        r.body["token_ids"]
        for r in engine.requests
        if r.method == "POST" and r.headers.get("X-Session-ID") == created["id"]
    ]
    assert len(prompts) == TURNS + 1
    input_ids, mask = sample["input_ids"], sample["loss_mask"]
    assert input_ids == prompts[-1] + script.completion(prompts[-1])
    for prompt in prompts:
        completion = script.completion(prompt)
        assert input_ids[len(prompt) : len(prompt) + len(completion)] == completion
        assert set(mask[len(prompt) : len(prompt) + len(completion)]) == {1}
    assert sum(mask) == sum(len(script.completion(p)) for p in prompts)


def test_sync_tool_conversation_is_one_bridged_exact_path(
    control: Control, engine: ScriptedEngine, script: Script
) -> None:
    created = control.create()
    client = anthropic_sdk(created)
    messages: list[Any] = [dict(m) for m in START]
    for _ in range(TURNS + 1):
        message = client.messages.create(
            model="claude-x", max_tokens=200, system="Be brief.", messages=messages, tools=TOOLS
        )
        messages.append(replayed_message(message))
        if message.stop_reason == "tool_use":
            messages.append(results_for(message))
    kinds = [b.type for b in message.content]
    assert kinds == ["thinking", "text"] and message.content[1].text == "The answer is 42."
    assert message.stop_reason == "end_turn" and message.id.startswith("msg_")
    assert message.content[0].signature.startswith("skycap-")
    first_call = messages[1]["content"]
    assert [b["type"] for b in first_call] == ["thinking", "text", "tool_use"]
    assert first_call[2]["id"].startswith("toolu_") and first_call[2]["input"] == {
        "query": "step 0"
    }
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    check_one_bridged_path(control, engine, script, created)


def test_streamed_conversation_is_one_bridged_exact_path(
    control: Control, engine: ScriptedEngine, script: Script
) -> None:
    created = control.create()
    client = anthropic_sdk(created)
    messages: list[Any] = [dict(m) for m in START]
    for _ in range(TURNS + 1):
        with client.messages.stream(
            model="claude-x", max_tokens=200, system="Be brief.", messages=messages, tools=TOOLS
        ) as stream:
            message = stream.get_final_message()
        messages.append(replayed_message(message))
        if message.stop_reason == "tool_use":
            messages.append(results_for(message))
    assert message.content[-1].text == "The answer is 42."
    check_one_bridged_path(control, engine, script, created)


def test_async_conversation_is_one_bridged_exact_path(
    control: Control, engine: ScriptedEngine, script: Script
) -> None:
    created = control.create()

    async def run() -> None:
        async with anthropic.AsyncAnthropic(
            base_url=created["anthropic_base_url"], api_key=created["api_key"], max_retries=0
        ) as client:
            messages: list[Any] = [dict(m) for m in START]
            for _ in range(TURNS + 1):
                message = await client.messages.create(
                    model="claude-x",
                    max_tokens=200,
                    messages=messages,
                    tools=TOOLS,
                    system=[
                        {
                            "type": "text",
                            "text": "Be brief.",
                            "cache_control": {"type": "ephemeral"},
                        }
                    ],
                )
                messages.append(replayed_message(message))
                if message.stop_reason == "tool_use":
                    messages.append(results_for(message))

    asyncio.run(run())
    check_one_bridged_path(control, engine, script, created)


def model_calls(control: Control, trajectory_id: str) -> list[dict[str, Any]]:
    document = control.document(trajectory_id).json()
    return [c for n in document["nodes"] for c in n["calls"]]


@pytest.mark.parametrize("streamed", [False, True])
def test_stop_sequences_cut_the_reply_and_replay_as_one_path(
    control: Control, engine: ScriptedEngine, qwen3_tokenizer: Any, streamed: bool
) -> None:
    created = control.create()
    client = anthropic_sdk(created)
    engine.queue("<think>\nok\n</think>\n\nThe answer is 42. DONE and then more text", "Fine.")
    asked = {"model": "claude-x", "max_tokens": 200, "stop_sequences": ["DONE", "42"]}
    if streamed:
        with client.messages.stream(messages=START, **asked) as stream:
            message = stream.get_final_message()
    else:
        message = client.messages.create(messages=START, **asked)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "42"
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[1].text == "The answer is "
    request = engine.generated[-1].body
    assert "stop" not in request["sampling_params"]  # applied by skycap, never forwarded
    (call,) = model_calls(control, created["id"])
    assert call["stop_string"] == "42" and call["finish_reason"] == "stop"
    assert call["dialect"] == "messages" and call["sampling"]["stop"] == ["DONE", "42"]
    # Replayed as returned, the cut reply is the node it was stored as: the next call bridges.
    messages = [*START, replayed_message(message), {"role": "user", "content": "more"}]
    second = client.messages.create(model="claude-x", max_tokens=200, messages=messages)
    assert second.stop_reason == "end_turn" and second.stop_sequence is None
    assert [c["bridged"] for c in model_calls(control, created["id"])] == [None, True]
    finished = control.finish(created["id"]).json()
    (sample,) = finished["samples"]
    prompt, kept = request["token_ids"], call["usage"]["completion_tokens"]
    sampled = qwen3_tokenizer.decode(sample["input_ids"][len(prompt) : len(prompt) + kept])
    assert sampled.endswith("42") and "DONE" not in sampled  # through the token completing "42"


NAMED = {"type": "function", "function": {"name": "search"}}


@pytest.mark.parametrize(
    ("choice", "recorded", "parallel"),
    [
        ({"type": "tool", "name": "search", "disable_parallel_tool_use": True}, NAMED, False),
        ({"type": "any"}, "required", None),
        ({"type": "auto", "disable_parallel_tool_use": False}, "auto", True),
    ],
)
def test_tool_choice_is_read_into_the_canonical_form_and_recorded(
    control: Control, choice: dict[str, Any], recorded: Any, parallel: bool | None
) -> None:
    created = control.create()
    message = anthropic_sdk(created).messages.create(
        model="claude-x", max_tokens=200, messages=START, tools=TOOLS, tool_choice=choice
    )
    assert message.stop_reason == "tool_use"  # a forced tool is still `tool_use` here
    document = control.document(created["id"]).json()
    (call,) = [c for n in document["nodes"] for c in n["calls"]]
    assert call["tool_choice"] == recorded and call["finish_reason"] == "tool_calls"
    assert call.get("parallel_tool_calls") is parallel


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(
    control: Control, engine: ScriptedEngine, qwen3_tokenizer: Any
) -> None:
    created = control.create()
    anthropic_sdk(created).messages.create(
        model="claude-x", max_tokens=200, messages=START, tools=TOOLS, tool_choice={"type": "none"}
    )
    prompt = qwen3_tokenizer.decode(engine.requests[-1].body["token_ids"])
    assert "<tools>" not in prompt and '"search"' not in prompt
    document = control.document(created["id"]).json()
    (call,) = [c for n in document["nodes"] for c in n["calls"]]
    assert call["tool_choice"] == "none" and call["omitted_tools"] == ["search"]


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "name": "search"},
        {"type": "tool"},
        {"type": "auto", "disable_parallel_tool_use": "yes"},
    ],
)
def test_a_bad_tool_choice_is_an_anthropic_shaped_400(
    control: Control, choice: dict[str, Any]
) -> None:
    created = control.create()
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_sdk(created).messages.create(
            model="claude-x", max_tokens=20, messages=START, tools=TOOLS, tool_choice=choice
        )
    assert caught.value.body["type"] == "error"
    assert "tool_choice" in caught.value.body["error"]["message"]


def test_count_tokens_is_the_rendered_prompt_length(
    control: Control, qwen3_renderer: LibraryRenderer
) -> None:
    created = control.create()
    messages = [{"role": "user", "content": "find x"}]
    counted = anthropic_sdk(created).messages.count_tokens(
        model="claude-x", system="Be brief.", messages=messages, tools=TOOLS
    )
    canonical = [{"role": "system", "content": "Be brief."}, *messages]
    tools = [{"type": "function", "function": {"name": "search", "description": "Search.",
              "parameters": TOOLS[0]["input_schema"]}}]  # fmt: skip
    assert counted.input_tokens == len(qwen3_renderer.render(canonical, tools).token_ids)
    assert control.finish(created["id"]).json()["calls"] == 0


def test_models_answer_in_anthropic_shape(control: Control) -> None:
    created = control.create()
    models = list(anthropic_sdk(created).models.list())
    assert [m.id for m in models] == ["policy"] and models[0].type == "model"
    with httpx.Client() as http:
        plain = http.get(created["base_url"] + "/models").json()
    assert plain["object"] == "list" and plain["data"][0]["id"] == "policy"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"max_tokens": None}, "`max_tokens` is required"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA==",
                                },
                            }
                        ],
                    }
                ]
            },
            "images are not supported in token mode yet",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "prefill",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "toolu_1",
                                "content": [
                                    {
                                        "type": "image",
                                        "source": {"type": "url", "url": "https://x/y.png"},
                                    }
                                ],
                            }
                        ],
                    },
                ]
            },
            "(in a message or a tool result)",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search"}
                            | {"input": {"query": "q"}},
                            {"type": "text", "text": "found"},
                        ],
                    },
                    {"role": "user", "content": "more"},
                ]
            },
            "messages[1].content[0] has type 'server_tool_use', which token mode cannot render",
        ),
    ],
)
def test_what_token_mode_cannot_run_is_a_clear_400(
    control: Control, extra: dict[str, Any], needle: str
) -> None:
    created = control.create()
    body = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "x"}], **extra}
    body = {k: v for k, v in body.items() if v is not None}
    with httpx.Client() as http:
        response = http.post(
            created["anthropic_base_url"] + "/v1/messages",
            json=body,
            headers={"x-api-key": created["api_key"], "anthropic-version": "2023-06-01"},
        )
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"]
    finished = control.finish(created["id"]).json()
    assert finished["calls"] == 0 and finished["warnings"] == ["no model call was captured"]

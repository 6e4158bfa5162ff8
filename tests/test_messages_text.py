"""Anthropic Messages in text mode: the unchanged anthropic SDK through skycap to a mock."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from server_fixtures import (
    Control,
    ServerThread,
    anthropic_sdk,
    replayed_message,
    run_harness,
    wait_for,
)

from skycap.mock.anthropic import ScriptedAnthropicUpstream
from skycap.mock.upstream import Reply
from skycap.server.options import ServerOptions

TOOLS = [
    {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"},
    }
]
SYSTEM = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
LS = {"function": {"name": "Bash", "arguments": '{"command": "ls"}'}}


def script(body: dict[str, Any]) -> Reply:
    """Think and call Bash until three tool results came back, then answer."""
    results = sum(
        1
        for m in body["messages"]
        if isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    )
    if results < 3:
        return Reply(reasoning_content=f"Step {results}: list.", content="On it.", tool_calls=[LS])
    return Reply(reasoning_content="Done.", content="Three listings.")


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedAnthropicUpstream]:
    with ScriptedAnthropicUpstream(script) as mock:
        yield mock


@pytest.fixture(scope="module")
def server(
    upstream: ScriptedAnthropicUpstream, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    options = ServerOptions(
        upstream.base_url,
        api_key="sk-upstream",
        require_api_key=True,
        record_dir=tmp_path_factory.mktemp("records"),
        upstream_timeout=2.0,
        max_body_size=200_000,
    )
    with ServerThread(options) as server:
        yield server


@pytest.fixture
def control(server: ServerThread) -> Iterator[Control]:
    with Control(server.url) as client:
        yield client


def results_for(message: Any) -> dict[str, Any]:
    blocks = [
        {"type": "tool_result", "tool_use_id": b.id, "content": [{"type": "text", "text": "a b"}]}
        for b in message.content
        if b.type == "tool_use"
    ]
    return {"role": "user", "content": blocks}


def conversation(created: dict[str, Any], call: Any) -> list[Any]:
    """Run the tool loop with `call(messages) -> Message`; the final messages list."""
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "go"}]}]
    for _ in range(4):
        message = call(messages)
        messages.append(replayed_message(message))
        if message.stop_reason != "tool_use":
            return messages
        messages.append(results_for(message))
    raise AssertionError("the script should end after three tool results")


def one_path(control: Control, created: dict[str, Any]) -> dict[str, Any]:
    document = control.document(created["id"]).json()
    calls = [c for n in document["nodes"] for c in n["calls"]]
    assert len(calls) == 4 and {c["dialect"] for c in calls} == {"messages"}
    finished = control.finish(created["id"]).json()
    assert finished["calls"] == 4 and "warnings" not in finished
    (sample,) = finished["samples"]
    return sample


def test_sync_calls_with_tools_and_thinking_stay_one_path(
    control: Control, upstream: ScriptedAnthropicUpstream
) -> None:
    created = control.create()
    client = anthropic_sdk(created)
    before = len(upstream.requests)
    messages = conversation(
        created,
        lambda m: client.messages.create(
            model="claude-x", max_tokens=64, system=SYSTEM, messages=m, tools=TOOLS
        ),
    )
    assert messages[-1]["content"][-1]["text"] == "Three listings."
    sample = one_path(control, created)
    roles = [m["role"] for m in sample["messages"]]
    assert roles == ["system", "user"] + ["assistant", "tool"] * 3 + ["assistant"]
    first = sample["messages"][2]
    assert first["reasoning_content"] == "Step 0: list."
    assert first["thinking_blocks"][0]["signature"].startswith("sig-")
    assert first["tool_calls"][0]["function"] == {"name": "Bash", "arguments": '{"command":"ls"}'}
    assert sample["messages"][0]["content"] == "You are terse."  # one block, no cache_control
    assert sample["messages"][3] == {
        "role": "tool",
        "tool_call_id": "toolu_mock_0",
        "content": "a b",
    }
    for request in upstream.requests[before:]:  # the harness key never goes upstream
        assert request.path == "/v1/messages"
        assert request.header("x-api-key") is None
        assert request.header("authorization") == "Bearer sk-upstream"
        assert request.header("anthropic-version") is not None


def test_streamed_calls_stay_one_path_and_relay_every_event(
    control: Control, upstream: ScriptedAnthropicUpstream
) -> None:
    created = control.create()
    client = anthropic_sdk(created)
    kinds: list[str] = []

    def call(messages: list[Any]) -> Any:
        with client.messages.stream(
            model="claude-x", max_tokens=64, system=SYSTEM, messages=messages, tools=TOOLS
        ) as stream:
            kinds.extend(event.type for event in stream)
            return stream.get_final_message()

    conversation(created, call)
    assert {"message_start", "content_block_start", "content_block_delta", "message_stop"} <= set(
        kinds
    )
    assert one_path(control, created)["messages"][-1]["content"] == "Three listings."


def test_async_calls_stay_one_path(control: Control) -> None:
    created = control.create()

    async def run() -> None:
        client = anthropic.AsyncAnthropic(
            base_url=created["anthropic_base_url"], api_key=created["api_key"], max_retries=0
        )
        messages: list[Any] = [{"role": "user", "content": "go"}]
        for _ in range(4):
            message = await client.messages.create(
                model="claude-x",
                max_tokens=64,
                system="You are terse.",
                messages=messages,
                tools=TOOLS,
            )
            messages.append(replayed_message(message))
            if message.stop_reason != "tool_use":
                break
            messages.append(results_for(message))
        await client.close()

    asyncio.run(run())
    one_path(control, created)


def test_count_tokens_is_forwarded_and_not_recorded(
    control: Control, upstream: ScriptedAnthropicUpstream
) -> None:
    created = control.create()
    counted = anthropic_sdk(created).messages.count_tokens(
        model="claude-x", messages=[{"role": "user", "content": "hello"}]
    )
    assert counted.input_tokens > 0
    assert upstream.requests[-1].path == "/v1/messages/count_tokens"
    assert upstream.requests[-1].header("x-api-key") is None
    finished = control.finish(created["id"]).json()
    assert finished["calls"] == 0 and finished["warnings"] == ["no model call was captured"]


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("messages", "status", "needle"),
    [
        ("nope", 400, "`messages` must be a list of objects"),
        ([{"role": "user", "content": [{"text": "no type"}]}], 400, "string `type`"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], 400, ".text` must be"),
        (
            [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}],
            400,
            "no earlier assistant message's tool_use",
        ),
        ([{"role": 7, "content": "hi"}], 400, "`messages[0].role` must be a string"),
    ],
)
def test_bad_input_gets_anthropic_errors(
    control: Control, server: ServerThread, messages: Any, status: int, needle: str
) -> None:
    created = control.create()
    with httpx.Client(base_url=created["anthropic_base_url"]) as http:
        response = http.post(
            "/v1/messages?beta=true",
            json={"model": "m", "max_tokens": 5, "messages": messages},
            headers={"x-api-key": created["api_key"], "anthropic-version": "2023-06-01"},
        )
    assert response.status_code == status
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and needle in error["message"]


def test_gate_errors_are_anthropic_shaped(control: Control, server: ServerThread) -> None:
    created = control.create()
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=server.url) as http:
        wrong = http.post(
            f"/t/{created['id']}/v1/messages", json=body, headers={"x-api-key": "sk-skycap-no"}
        )
        unknown = http.post("/t/tr_0123456789abcdef/v1/messages", json=body)
        big = http.post(
            f"/t/{created['id']}/v1/messages",
            content=b'{"pad": "' + b"x" * 300_000 + b'"}',
            headers={"x-api-key": created["api_key"]},
        )
        control.finish(created["id"])
        ended = http.post(
            f"/t/{created['id']}/v1/messages", json=body, headers={"x-api-key": created["api_key"]}
        )
        missing = http.get(
            f"/t/{created['id']}/v1/nothing", headers={"anthropic-version": "2023-06-01"}
        )
    assert (wrong.status_code, error_of(wrong)["type"]) == (401, "authentication_error")
    assert error_of(wrong)["code"] == "invalid_api_key"
    assert (unknown.status_code, error_of(unknown)["type"]) == (404, "not_found_error")
    assert (big.status_code, error_of(big)["type"]) == (413, "request_too_large")
    assert (ended.status_code, error_of(ended)["code"]) == (410, "trajectory_closed")
    assert error_of(ended)["type"] == "invalid_request_error"
    assert (missing.status_code, error_of(missing)["type"]) == (404, "not_found_error")


def test_the_sdk_reads_skycaps_errors(control: Control) -> None:
    created = control.create()
    client = anthropic.Anthropic(
        base_url=created["anthropic_base_url"], api_key="sk-skycap-wrong", max_retries=0
    )
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert "api_key is required" in str(refused.value)
    assert refused.value.body["error"]["code"] == "invalid_api_key"


def test_upstream_failures_are_recorded_and_answered_in_shape(
    control: Control, upstream: ScriptedAnthropicUpstream
) -> None:
    created = control.create()
    client = anthropic_sdk(created)
    hi = [{"role": "user", "content": "hi"}]
    upstream.fail_next("status", status=529)
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        client.messages.create(model="m", max_tokens=5, messages=hi)
    assert overloaded.value.status_code == 529
    assert overloaded.value.body["error"]["type"] == "overloaded_error"
    upstream.fail_next("break_stream")
    with pytest.raises(anthropic.APIStatusError, match="upstream stream interrupted") as broken:
        with client.messages.stream(model="m", max_tokens=5, messages=hi) as stream:
            stream.get_final_message()  # a failed stream (its `error` event), never a short one
    assert broken.value.body["error"]["type"] == "api_error"
    upstream.fail_next("hang")
    with pytest.raises(anthropic.APIStatusError) as hung:
        client.messages.create(model="m", max_tokens=5, messages=hi)
    assert hung.value.status_code == 502 and "timed out after 2 s" in str(hung.value)
    assert hung.value.body["type"] == "error"
    upstream.fail_next("no_choices")
    with client.messages.stream(model="m", max_tokens=5, messages=hi) as stream:
        list(stream)
    document = wait_for(
        lambda: (d := control.document(created["id"]).json())["failures"][3:] and d,
        what="four recorded failures",
    )
    errors = [f["error"] for f in document["failures"]]
    assert document["failures"][0]["status"] == 529
    assert errors[1].startswith("upstream stream interrupted")
    assert errors[2] == "upstream: timed out after 2 s"
    assert errors[3].startswith("unreadable stream: no stop_reason")
    assert document["nodes"] == []


async def test_the_pool_hands_out_the_anthropic_base_url(server: ServerThread) -> None:
    from skycap import CapturePool

    async with CapturePool([server.url]) as pool:
        trajectory = await pool.create()
        empty = await pool.create()
        assert trajectory.anthropic_base_url == trajectory.base_url.removesuffix("/v1")
        async with anthropic.AsyncAnthropic(
            base_url=trajectory.anthropic_base_url, api_key=trajectory.api_key, max_retries=0
        ) as client:
            await client.messages.create(
                model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
        result = await trajectory.finish({"reward": 1})
        nothing = await empty.finish({"reward": 0})
    assert (result.calls, result.warnings, len(result.samples)) == (1, [], 1)
    assert (nothing.calls, nothing.warnings) == (0, ["no model call was captured"])

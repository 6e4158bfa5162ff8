"""Tests for the scripted OpenAI-compatible upstream, driven by the unchanged openai SDK."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from skycap.dialects.chat import StreamAssembler
from skycap.mock.replies import MODEL
from skycap.mock.upstream import Reply, ScriptedUpstream

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CALLS = [
    {
        "id": "call_w",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris, France"}'},
    },
    {"id": "call_t", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as server:
        yield server


def sdk(upstream: ScriptedUpstream) -> openai.OpenAI:
    return openai.OpenAI(api_key="sk-harness", base_url=upstream.base_url, max_retries=0)


# One client for the module: building one per call costs tens of milliseconds (TLS set-up).
HTTP = httpx.Client(timeout=5)


def post(upstream: ScriptedUpstream, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return HTTP.post(f"{upstream.base_url}/chat/completions", json=body, **kwargs)


def stream_chunks(upstream: ScriptedUpstream, body: dict[str, Any]) -> list[bytes]:
    url = f"{upstream.base_url}/chat/completions"
    with HTTP.stream("POST", url, json=body | {"stream": True}) as response:
        assert response.headers["content-type"] == "text/event-stream"
        return list(response.iter_raw())


def test_default_echo_reply_and_request_log(upstream: ScriptedUpstream) -> None:
    raw = b'{"model": "policy",   "messages": [{"role": "user", "content": "hi \\u00e9"}]}'
    response = HTTP.post(
        f"{upstream.base_url}/chat/completions",
        content=raw,
        headers={"Authorization": "Bearer secret", "X-Stainless-Retry-Count": "0"},
    )
    reply = response.json()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "echo: hi é"}
    assert reply["model"] == "policy" and reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["total_tokens"] > 0
    request = upstream.requests[-1]
    assert (request.method, request.path, request.body) == ("POST", "/v1/chat/completions", raw)
    assert request.header("authorization") == "Bearer secret"
    assert request.header("X-STAINLESS-RETRY-COUNT") == "0"
    assert request.header("idempotency-key") is None


def test_sync_sdk_reads_content_reasoning_and_usage(upstream: ScriptedUpstream) -> None:
    usage = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
    upstream.script = [Reply(content="Sunny.", reasoning_content="Look it up.", usage=usage)]
    completion = sdk(upstream).chat.completions.create(model="policy", messages=MESSAGES)
    message = completion.choices[0].message
    assert message.content == "Sunny."
    assert message.model_extra == {"reasoning_content": "Look it up."}
    assert completion.usage is not None and completion.usage.total_tokens == 16
    assert orjson.loads(upstream.requests[-1].body)["messages"] == MESSAGES
    assert upstream.requests[-1].header("authorization") == "Bearer sk-harness"


def test_sync_sdk_stream_helper_assembles_tool_calls(upstream: ScriptedUpstream) -> None:
    upstream.script = lambda body: Reply(content="Checking.", tool_calls=TOOL_CALLS)
    with sdk(upstream).chat.completions.stream(
        model="policy", messages=MESSAGES, tools=TOOLS
    ) as stream:
        completion = stream.get_final_completion()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in TOOL_CALLS
    ]


def test_stream_is_several_writes_and_assembles_like_the_json_reply() -> None:
    reply = Reply(
        content="It is sunny today.", reasoning_content="Weather, hmm.", tool_calls=TOOL_CALLS
    )
    with ScriptedUpstream(lambda body: reply, chunk_delay=0.005) as upstream:
        body = {"model": "policy", "messages": MESSAGES, "stream_options": {"include_usage": True}}
        chunks = stream_chunks(upstream, body)
        plain = post(upstream, body).json()
    assert len(chunks) > 5  # role, reasoning, content and argument pieces arrive apart
    assembler = StreamAssembler()
    for piece in chunks:
        assembler.feed(piece)
    assert assembler.done
    assert assembler.result() == (plain["choices"][0]["message"], "tool_calls")
    assert assembler.usage is not None
    assert assembler.usage["completion_tokens"] == plain["usage"]["completion_tokens"]
    events = b"".join(chunks).split(b"\n\n")
    argument_pieces = [e for e in events if b'"arguments":"' in e and b'"call_' not in e]
    assert len(argument_pieces) > 2


def test_usage_chunk_only_when_asked(upstream: ScriptedUpstream) -> None:
    assembler = StreamAssembler()
    for piece in stream_chunks(upstream, {"model": "m", "messages": MESSAGES}):
        assembler.feed(piece)
    assert assembler.usage is None and assembler.result()[1] == "stop"


async def test_async_sdk_stream_and_tools(upstream: ScriptedUpstream) -> None:
    upstream.script = [Reply(content="Hello there, async world."), Reply(tool_calls=TOOL_CALLS)]
    client = openai.AsyncOpenAI(api_key="k", base_url=upstream.base_url, max_retries=0)
    stream = await client.chat.completions.create(
        model="policy",
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    async for event in stream:
        for choice in event.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        usage = event.usage or usage
    assert (text, finish) == ("Hello there, async world.", "stop")
    assert usage is not None and usage.completion_tokens > 0
    completion = await client.chat.completions.create(
        model="policy", messages=MESSAGES, tools=TOOLS
    )
    message = completion.choices[0].message
    assert message.content is None
    assert [c.function.arguments for c in message.tool_calls] == ['{"city": "Paris, France"}', "{}"]
    assert completion.choices[0].finish_reason == "tool_calls"
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await client.close()


def test_script_queue_runs_out_loudly_and_callables_see_the_body(
    upstream: ScriptedUpstream,
) -> None:
    upstream.script = [{"content": "one"}]
    assert post(upstream, {"messages": []}).json()["choices"][0]["message"]["content"] == "one"
    exhausted = post(upstream, {"messages": []})
    assert exhausted.status_code == 500
    assert "ran out after 1 replies" in exhausted.json()["error"]["message"]
    upstream.script = lambda body: {"content": str(body["temperature"])}
    reply = post(upstream, {"messages": [], "temperature": 0.25}).json()
    assert reply["choices"][0]["message"]["content"] == "0.25"


def test_unknown_routes_and_bad_bodies(upstream: ScriptedUpstream) -> None:
    missing = HTTP.get(f"{upstream.base_url}/embeddings")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    bad = HTTP.post(f"{upstream.base_url}/chat/completions", content=b"{nope")
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]


def test_fault_status_then_normal(upstream: ScriptedUpstream) -> None:
    upstream.fail_next("status", status=401, body=b'{"error": "no key"}')
    refused = post(upstream, {"messages": MESSAGES})
    assert (refused.status_code, refused.content) == (401, b'{"error": "no key"}')
    upstream.fail_next("status", status=503)
    server_error = post(upstream, {"messages": MESSAGES})
    assert server_error.status_code == 503
    assert server_error.json()["error"]["type"] == "api_error"
    assert post(upstream, {"messages": MESSAGES}).status_code == 200


def test_fault_times_and_clear(upstream: ScriptedUpstream) -> None:
    upstream.fail_next("status", status=502, times=2)
    assert [post(upstream, {"messages": []}).status_code for _ in range(3)] == [502, 502, 200]
    upstream.fail_next("status", status=500, times=None)
    assert [post(upstream, {"messages": []}).status_code for _ in range(3)] == [500] * 3
    upstream.clear_faults()
    assert post(upstream, {"messages": []}).status_code == 200
    assert HTTP.get(f"{upstream.base_url}/models").status_code == 200
    with pytest.raises(ValueError, match="unknown fault 'explode'"):
        upstream.fail_next("explode")  # type: ignore[arg-type]


def test_fault_garbage_and_no_choices(upstream: ScriptedUpstream) -> None:
    upstream.fail_next("garbage")
    garbage = post(upstream, {"messages": []})
    assert garbage.status_code == 200
    with pytest.raises(ValueError):
        garbage.json()
    upstream.fail_next("no_choices")
    empty = post(upstream, {"messages": []})
    assert empty.status_code == 200 and "choices" not in empty.json()
    for kind, problem in [("garbage", "is not JSON"), ("no_choices", "no finish_reason")]:
        upstream.fail_next(kind)  # type: ignore[arg-type]
        assembler = StreamAssembler()
        for piece in stream_chunks(upstream, {"messages": []}):
            assembler.feed(piece)
        with pytest.raises(ValueError, match=problem):
            assembler.result()


def test_fault_break_stream_cuts_the_body(upstream: ScriptedUpstream) -> None:
    upstream.fail_next("break_stream")
    received: list[bytes] = []
    url = f"{upstream.base_url}/chat/completions"
    body = {"messages": [], "stream": True}
    with pytest.raises(httpx.RemoteProtocolError):
        with HTTP.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            for piece in response.iter_raw():
                received.append(piece)
    assert b"data: " in b"".join(received)
    assembler = StreamAssembler()
    for piece in received:
        assembler.feed(piece)
    assert not assembler.finish_seen
    upstream.fail_next("break_stream")
    with pytest.raises(httpx.RemoteProtocolError):
        post(upstream, {"messages": []})
    assert post(upstream, {"messages": []}).status_code == 200


def test_fault_sleep_delays_then_answers(upstream: ScriptedUpstream) -> None:
    upstream.fail_next("sleep", seconds=0.2)
    started = time.monotonic()
    assert post(upstream, {"messages": MESSAGES}).status_code == 200
    assert time.monotonic() - started >= 0.2


def test_fault_hang_is_released_by_stop() -> None:
    upstream = ScriptedUpstream()
    upstream.start()
    upstream.fail_next("hang")
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            post(upstream, {"messages": []}, headers={"x-test": "hang"})
        except httpx.HTTPError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    upstream.wait_for_requests(1)
    assert upstream.requests[0].header("x-test") == "hang"
    assert caller.is_alive()
    upstream.stop()
    caller.join(timeout=5)
    assert not caller.is_alive()
    assert isinstance(outcome[0], httpx.RemoteProtocolError)


def test_wait_for_requests_times_out(upstream: ScriptedUpstream) -> None:
    with pytest.raises(TimeoutError, match="got 0 requests, expected 1"):
        upstream.wait_for_requests(1, timeout=0.05)

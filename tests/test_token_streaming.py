"""Token mode streams as the engine generates: all three SDKs, keep-alives, faults."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from server_fixtures import Control, ServerThread, control, wait_for
from token_stream_fixtures import ANSWER, START, _engine_reset, engine, server

from skycap.dialects.chat import DIALECT as CHAT
from skycap.dialects.messages import DIALECT as MESSAGES
from skycap.mock.engine import ScriptedEngine
from skycap.mock.engine_wire import scripted_logprob
from skycap.tokens.backend import TokenBackend
from skycap.tokens.engine import VLLMEngine
from skycap.tokens.streaming import ReplyStream
from skycap.trajectory import Trajectory

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]
THOUGHT = "<think>\nI will look it up, carefully: 日本語 and émoji 🙂.\n</think>\n\n"


def _chat(trajectory: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )


def test_chat_stream_relays_deltas_as_the_engine_generates(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    engine.queue(THOUGHT + ANSWER)
    engine.hold_stream(before_chunk=12)
    stream = _chat(trajectory).chat.completions.create(model="p", messages=START, stream=True)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and getattr(delta, "reasoning_content", None):
            break
    # The first reasoning delta came while the engine was held mid-generation.
    assert engine.streams_finished == 0
    engine.resume_stream()
    chunks.extend(stream)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    # Joined, the stream is the non-streamed reply and the stored node.
    nodes = control.document(trajectory["id"]).json()["nodes"]
    stored = nodes[-1]["message"]
    assert content == stored["content"] == ANSWER
    assert reasoning == stored["reasoning_content"]


def test_keepalives_fill_the_silence_before_the_first_token(
    control: Control, engine: ScriptedEngine, server: ServerThread
) -> None:
    trajectory = control.create()
    engine.queue(ANSWER)
    engine.hold_stream(before_chunk=0)  # a long prefill: no token yet
    url = f"{trajectory['base_url']}/chat/completions"
    body = {"model": "p", "messages": START, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            lines.append(line)
            if lines.count(": keep-alive") == 3:
                engine.resume_stream()  # the engine starts generating only now
    content = next(i for i, line in enumerate(lines) if '"content"' in line)
    keepalives = [i for i, line in enumerate(lines) if line == ": keep-alive"]
    assert len(keepalives) >= 3 and keepalives[2] < content
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"


def test_anthropic_stream_thinking_text_and_a_tool_call_split_across_chunks(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    base = trajectory["base_url"].removesuffix("/v1")
    client = anthropic.Anthropic(base_url=base, api_key=trajectory["api_key"], max_retries=0)
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "naïve 🙂"}}\n</tool_call>'
    engine.queue(THOUGHT + "Let me search. " + call)
    tools = [
        {
            "name": "search",
            "description": "Search.",
            "input_schema": TOOLS[0]["function"]["parameters"],
        }
    ]
    kinds: list[str] = []
    with client.messages.stream(model="p", max_tokens=500, messages=START, tools=tools) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    blocks = [b.type for b in final.content]
    assert blocks == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"query": "naïve 🙂"}
    assert final.stop_reason == "tool_use"
    assert kinds.count("thinking") > 3 and kinds.count("text") > 1  # streamed in pieces
    assert kinds.index("signature") < kinds.index("text")
    # The same reply as the non-streamed one: the stored node is what the harness will echo.
    nodes = control.document(trajectory["id"]).json()["nodes"]
    stored = nodes[-1]["message"]
    assert final.content[0].thinking == stored["reasoning_content"]
    assert final.content[0].signature == stored["thinking_blocks"][0]["signature"]
    assert final.content[1].text == stored["content"] == "Let me search."
    assert final.content[2].id == stored["tool_calls"][0]["id"]
    # Echoing the streamed reply extends the same path.
    engine.queue("Found it.")
    history: list[Any] = [
        *START,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
    ]
    history.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": final.content[2].id, "content": "42"}
            ],
        }
    )
    client.messages.create(model="p", max_tokens=100, messages=history, tools=tools)
    document = control.document(trajectory["id"]).json()
    assert len([n for n in document["nodes"] if n["author"] == "model"]) == 2
    assert document["failures"] == []


def test_responses_stream_equals_the_stored_reply(control: Control, engine: ScriptedEngine) -> None:
    trajectory = control.create()
    engine.queue(THOUGHT + ANSWER)
    engine.hold_stream(before_chunk=0)
    client = _chat(trajectory)
    deltas: list[str] = []
    kinds: list[str] = []
    with client.responses.stream(model="p", input="find x") as stream:
        for event in stream:
            kinds.append(event.type)
            if kinds.count("keepalive") == 2:
                engine.resume_stream()  # the SDK read two keep-alive events meanwhile
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds.index("keepalive") < kinds.index("response.reasoning_text.delta")
    assert len(deltas) > 3 and "".join(deltas) == final.output_text == ANSWER
    assert [item.type for item in final.output] == ["reasoning", "message"]
    stored = control.document(trajectory["id"]).json()["nodes"][-1]["message"]
    assert final.output[0].content[0].text == stored["reasoning_content"]
    assert final.output[0].id == stored["reasoning_items"][0]["id"]
    assert final.output[0].encrypted_content == stored["reasoning_items"][0]["encrypted_content"]
    # A follow-up naming the reply's items stays on its path.
    engine.queue("Next.")
    client.responses.create(model="p", previous_response_id=final.id, input="again")
    document = control.document(trajectory["id"]).json()
    assert document["failures"] == []
    models = [n for n in document["nodes"] if n["author"] == "model"]
    assert len(models) == 2


def test_record_holds_exactly_what_the_engine_streamed(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    engine.queue(THOUGHT + ANSWER)
    list(_chat(trajectory).chat.completions.create(model="p", messages=START, stream=True))
    result = control.finish(trajectory["id"]).json()
    sample = result["samples"][0]
    sent = engine.generated[-1].body
    assert sent["stream"] is True
    prompt = sent["token_ids"]
    completion = sample["input_ids"][len(prompt) :]
    assert sample["input_ids"][: len(prompt)] == prompt
    expected = [scripted_logprob(t, len(prompt) + i) for i, t in enumerate(completion)]
    assert sample["logprobs"][len(prompt) :] == pytest.approx(expected)
    assert completion[-1] == engine.stop_token_id
    experts = sample["routed_experts"]
    assert experts["shape"][0] == len(sample["input_ids"])  # one row per position


def test_a_stream_that_breaks_is_an_engine_failure(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    engine.queue(THOUGHT + ANSWER)
    engine.fail_next("stream_break")
    with pytest.raises(openai.APIError) as failed:
        list(_chat(trajectory).chat.completions.create(model="p", messages=START, stream=True))
    assert "engine" in str(failed.value.message)
    document = control.document(trajectory["id"]).json()
    assert document["nodes"] == [] or all(n["author"] != "model" for n in document["nodes"])
    assert document["failures"] and "engine" in document["failures"][-1]["error"]
    engine.queue(ANSWER)
    engine.fail_next("stream_no_finish")
    with pytest.raises(openai.APIError) as failed:
        list(_chat(trajectory).chat.completions.create(model="p", messages=START, stream=True))
    assert "without a finish reason" in str(failed.value.message)
    # The server keeps serving.
    engine.queue(ANSWER)
    chunks = list(_chat(trajectory).chat.completions.create(model="p", messages=START, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER


def test_a_stop_string_cuts_the_stream_and_aborts_the_engine_request(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    engine.queue("alpha beta STOP gamma delta epsilon zeta eta theta")
    engine.hold_stream(before_chunk=8)  # the engine would go on: skycap must abort it
    chunks = list(
        _chat(trajectory).chat.completions.create(
            model="p", messages=START, stream=True, stop=["STOP"]
        )
    )
    aborted = engine.wait_for_abort()
    assert aborted.startswith("generate-tokens-skycap-")
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "alpha beta "  # OpenAI's semantics: the text before the stop string
    assert chunks[-1].choices[0].finish_reason == "stop"
    node = control.document(trajectory["id"]).json()["nodes"][-1]
    assert node["message"]["content"] == content
    assert node["calls"][0]["stop_string"] == "STOP"


def test_a_harness_that_disconnects_mid_stream_still_commits(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    engine.queue(THOUGHT + ANSWER)
    engine.hold_stream(before_chunk=6)
    url = f"{trajectory['base_url']}/chat/completions"
    with httpx.stream("POST", url, json={"model": "p", "messages": START, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # the harness goes away after the first event
    engine.resume_stream()

    def committed() -> bool:
        nodes = control.document(trajectory["id"]).json()["nodes"]
        return any(n["author"] == "model" for n in nodes)

    wait_for(committed, timeout=10, what="the call to commit")


def test_a_finish_during_a_stream_ends_it_with_an_error_event(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    engine.queue(THOUGHT + ANSWER)
    engine.hold_stream(before_chunk=4)
    stream = _chat(trajectory).chat.completions.create(model="p", messages=START, stream=True)
    first = next(iter(stream))  # the stream is open and the engine is held mid-reply
    assert first.choices[0].delta.role == "assistant"
    assert control.finish(trajectory["id"]).status_code == 200
    with pytest.raises(openai.APIError, match="closed while this call ran"):
        list(stream)


def test_a_length_stop_inside_the_thinking_streams_the_non_streamed_reply(
    control: Control, engine: ScriptedEngine
) -> None:
    replies = []
    for stream in (True, False):
        trajectory = control.create()
        engine.queue(THOUGHT + ANSWER)
        sdk = _chat(trajectory).chat.completions
        if stream:
            chunks = list(sdk.create(model="p", messages=START, stream=True, max_tokens=8))
            assert chunks[-1].choices[0].finish_reason == "length"
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            joined = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        else:
            reply = sdk.create(model="p", messages=START, max_tokens=8).choices[0]
            assert reply.finish_reason == "length"
            joined = reply.message.reasoning_content
        stored = control.document(trajectory["id"]).json()["nodes"][-1]["message"]
        assert joined == stored["reasoning_content"]
        replies.append(joined)
    assert replies[0] == replies[1] and replies[0].startswith("I will look")


class _WireThatCannotStream(VLLMEngine):
    """An engine wire without streaming: the reply is synthesised at the end."""

    def stream_request(self, body: Any, request_id: str) -> None:
        return None


@pytest.mark.parametrize("dialect", [MESSAGES, CHAT])
def test_a_wire_that_cannot_stream_sends_one_whole_reply_after_the_start(
    dialect: Any, engine: ScriptedEngine, qwen3_renderer: Any
) -> None:
    body = {"model": "p", "max_tokens": 64, "messages": START, "stream": True}

    async def run() -> tuple[bytes, Any]:
        backend = TokenBackend(
            upstream_url=engine.url, renderer=qwen3_renderer, engine=_WireThatCannotStream()
        )
        trajectory = Trajectory("tr_00000000000000c1", capture=backend.capture)
        stream = ReplyStream(30)
        try:
            reply = await backend.call(trajectory, dialect.read(body), dialect, stream)
        finally:
            await backend.close()
        return b"".join([chunk async for chunk in stream.chunks()]), reply

    engine.queue(THOUGHT + ANSWER)
    sent, reply = asyncio.run(run())
    assert reply.status == 200 and reply.call is not None
    # What the harness got is one reply, the one a retry replays: no second start.
    assert _events(sent) == _events(reply.body)
    assert ANSWER.encode() in sent


def _events(sse: bytes) -> list[str]:
    """Each event's type (Messages) or each chunk's delta keys (Chat), in order."""
    kinds = []
    for line in sse.decode().splitlines():
        if line.startswith("event: "):
            kinds.append(line[len("event: ") :])
        elif line.startswith("data: {") and '"choices"' in line:
            kinds.append(",".join(sorted(orjson.loads(line[6:])["choices"][0]["delta"])))
    return kinds

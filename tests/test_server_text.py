"""Text mode through real sockets with the unchanged openai SDK: capture, streams, scenarios."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import openai
import pytest
from server_fixtures import Control, make_server, upstream

from skycap.mock.upstream import Reply, ScriptedUpstream

TOOLS_A = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
TOOLS_B = [
    {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
]
SEARCH = {"function": {"name": "search", "arguments": '{"q": "skycap capture proxy"}'}}


def sdk(trajectory: dict[str, Any], **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0, **kwargs
    )


def assembled(chunks: list[Any]) -> dict[str, Any]:
    """What a harness builds from streamed chunks and sends back as the assistant message."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            extra = (delta.model_extra or {}).get("reasoning_content")
            if extra:
                reasoning.append(extra)
            for call in delta.tool_calls or []:
                entry = calls.setdefault(
                    call.index,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                entry["id"] = call.id or entry["id"]
                if call.function and call.function.name:
                    entry["function"]["name"] += call.function.name
                if call.function and call.function.arguments:
                    entry["function"]["arguments"] += call.function.arguments
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(content) if content else None,
    }
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def check_report(record_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """`skycap check` output, one entry per trajectory: its lines joined."""
    from skycap.cli.main import main

    main(["check", str(record_dir)])
    report: dict[str, list[str]] = {}
    current = None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("tr_"):
            current = line.split()[0]
            report[current] = [line]
        elif current is not None and line.startswith("  "):
            report[current].append(line.strip())
    return {key: "\n".join(lines) for key, lines in report.items()}


def test_linear_tool_conversation_with_the_sync_sdk(
    make_server, upstream: ScriptedUpstream, tmp_path: Path, capsys
) -> None:
    upstream.script = [
        Reply(content=None, reasoning_content="I should search", tool_calls=[SEARCH]),
        Reply(content="Found it: skycap records calls."),
        Reply(content=None, tool_calls=[SEARCH]),
        Reply(content="Still the same answer."),
        Reply(content="Bye!", reasoning_content="wrap up"),
    ]
    server = make_server(record_dir=tmp_path, api_key="sk-upstream")
    control = Control(server.url)
    trajectory = control.create({"task": "linear"})
    client = sdk(trajectory)
    messages: list[Any] = [{"role": "system", "content": "You are terse."}]
    user_turns = iter(["find skycap", "again please", "thanks"])
    messages.append({"role": "user", "content": next(user_turns)})
    for _ in range(5):
        response = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS_A, temperature=0.7
        )
        message = response.choices[0].message
        messages.append(message)  # the SDK object, exactly as a harness appends it
        if message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "result"}
            )
        else:
            messages.append({"role": "user", "content": next(user_turns, "bye")})
    result = control.finish(trajectory["id"], annotations={"reward": 1.0}).json()
    assert len(result["samples"]) == 1
    sample = result["samples"][0]
    model_nodes = [
        i
        for i, m in zip(sample["path"], sample["messages"], strict=True)
        if m["role"] == "assistant"
    ]
    assert sample["targets"] == model_nodes and len(model_nodes) == 5
    assert sample["messages"][2]["reasoning_content"] == "I should search"
    # The upstream got the raw body with its own key, never the harness's.
    sent = upstream.requests[-1]
    assert sent.header("authorization") == "Bearer sk-upstream"
    assert trajectory["api_key"] not in str(sent.headers)
    document = control.document(trajectory["id"]).json()
    calls = [c for node in document["nodes"] for c in node["calls"]]
    assert len(calls) == 5 and all(c["sampling"] == {"temperature": 0.7} for c in calls)
    assert all(c["model"] == "policy" and c["tools"] for c in calls)
    assert list(document["tools"].values()) == [TOOLS_A]
    report = check_report(tmp_path, capsys)
    assert report[trajectory["id"]] == f"{trajectory['id']}  finished  linear"
    control.close()


async def test_streamed_tool_conversation_with_the_async_sdk(
    make_server, upstream: ScriptedUpstream
) -> None:
    upstream.script = [
        Reply(reasoning_content="let me look this up", content="One moment.", tool_calls=[SEARCH]),
        Reply(content="Here is a long answer that arrives in many small pieces."),
    ]
    server = make_server()
    control = Control(server.url)
    trajectory = await asyncio.to_thread(control.create)
    client = openai.AsyncOpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )
    messages: list[Any] = [{"role": "user", "content": "stream please"}]
    replies = []
    for _ in range(2):
        stream = await client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=TOOLS_A,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert len(chunks) > 5  # relayed chunk by chunk, not as one buffered body
        assert chunks[-1].usage is not None
        reply = assembled(chunks)
        replies.append(reply)
        messages.append(reply)
        if reply.get("tool_calls"):
            messages.append({"role": "tool", "tool_call_id": "call_0", "content": "found"})
    await client.close()
    # A finish right after the stream always finds the reply (held-back tail, http.md §3.1).
    result = await asyncio.to_thread(control.finish, trajectory["id"])
    sample = result.json()["samples"][0]
    assert sample["messages"][1] == replies[0]
    assert replies[0]["tool_calls"][0]["function"] == SEARCH["function"]
    assert replies[0]["reasoning_content"] == "let me look this up"
    assert len(sample["targets"]) == 2 and len(result.json()["samples"]) == 1
    document = (await asyncio.to_thread(control.document, trajectory["id"])).json()
    calls = [c for node in document["nodes"] for c in node["calls"]]
    assert [c["finish_reason"] for c in calls] == ["tool_calls", "stop"]
    assert all(c["usage"]["total_tokens"] > 0 for c in calls)
    control.close()


def test_fork_scenarios_are_explained_by_skycap_check(
    make_server, upstream: ScriptedUpstream, tmp_path: Path, capsys
) -> None:
    counter = itertools.count()

    def script(body: dict[str, Any]) -> Reply:
        n = next(counter)
        if body["messages"][-1].get("content") == "think first":
            return Reply(content=f"answer {n}", reasoning_content="hidden thoughts")
        return Reply(content=f"answer {n}")

    upstream.script = script
    server = make_server(record_dir=tmp_path)
    control = Control(server.url)
    system = {"role": "system", "content": "You are a helpful agent."}

    def run(turns: list[tuple[list[dict], list | None]]) -> str:
        trajectory = control.create()
        client = sdk(trajectory)
        for messages, tools in turns:
            extra = {"tools": tools} if tools else {}
            client.chat.completions.create(model="policy", messages=messages, **extra)
        control.finish(trajectory["id"])
        return trajectory["id"]

    def reply_of(trajectory_id: str, index: int) -> dict:
        return control.document(trajectory_id).json()["nodes"][index]["message"]

    u1, u2, u3 = ({"role": "user", "content": t} for t in ("first", "second", "third"))
    resample = run([([system, u1], None), ([system, u1], None)])

    edited = control.create()
    client = sdk(edited)
    first = (
        client.chat.completions.create(
            model="policy", messages=[system, {"role": "user", "content": "think first"}]
        )
        .choices[0]
        .message
    )
    stripped = {"role": "assistant", "content": first.content}  # reasoning_content dropped
    client.chat.completions.create(
        model="policy",
        messages=[system, {"role": "user", "content": "think first"}, stripped, u2],
    )
    control.finish(edited["id"])

    compaction = control.create()
    client = sdk(compaction)
    a1 = client.chat.completions.create(model="policy", messages=[system, u1]).choices[0].message
    client.chat.completions.create(model="policy", messages=[system, u1, a1, u2])
    summary = {"role": "user", "content": "Summary so far: two questions answered."}
    client.chat.completions.create(model="policy", messages=[system, summary, u3])
    control.finish(compaction["id"])

    tools_changed = control.create()
    client = sdk(tools_changed)
    a1 = (
        client.chat.completions.create(model="policy", messages=[system, u1], tools=TOOLS_A)
        .choices[0]
        .message
    )
    client.chat.completions.create(model="policy", messages=[system, u1, a1, u2], tools=TOOLS_B)
    control.finish(tools_changed["id"])

    subagent = run(
        [
            ([system, u1], None),
            ([{"role": "system", "content": "You are a research subagent."}, u3], None),
        ]
    )
    report = check_report(tmp_path, capsys)
    assert "2 paths" in report[resample]
    assert "resample: a second reply to the same history" in report[resample]
    assert (
        "edited reply: the harness sent back the model's reply with reasoning_content dropped"
        in (report[edited["id"]])
    )
    assert reply_of(edited["id"], 2)["reasoning_content"] == "hidden thoughts"
    assert (
        "(under node 0, vs node 1): compaction: a user message in place of the 4 messages "
        "from node 1 to node 4" in (report[compaction["id"]])
    )
    assert "(new root, vs node 0): tools or model" in report[tools_changed["id"]]
    assert (
        "(new root, vs node 0): different message: a different system message" in (report[subagent])
    )
    control.close()


def test_stream_chunks_flow_through_and_the_tail_waits_for_the_commit(
    make_server, upstream: ScriptedUpstream
) -> None:
    import httpx

    upstream.chunk_delay = 0.02
    upstream.script = [Reply(content="a reply long enough to arrive in several pieces")]
    server = make_server()
    control = Control(server.url)
    trajectory = control.create()

    def model_nodes() -> int:
        live = server.store.get(trajectory["id"])
        return sum(1 for node in live.trajectory.graph if node.is_model)

    seen_before_commit = seen_at_finish = None
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True}
    url = f"{trajectory['base_url']}/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=10) as response:
        for line in response.iter_lines():
            if '"content":"a reply' in line:
                seen_before_commit = server.run_in_loop(model_nodes)  # relayed before the end
            if '"finish_reason":"stop"' in line:
                seen_at_finish = server.run_in_loop(model_nodes)  # held back until committed
    assert seen_before_commit == 0 and seen_at_finish == 1
    control.close()


def test_the_sdk_stream_helpers_replayed_messages_stay_one_path(
    make_server, upstream: ScriptedUpstream
) -> None:
    """`chat.completions.stream()`'s final message, replayed with model_dump(), carries
    `parsed`, tool-call `index`, `parsed_arguments` and `reasoning`: folded away."""
    upstream.script = [
        Reply(reasoning_content="let me look", content="One moment.", tool_calls=[SEARCH]),
        Reply(content="Found it."),
    ]
    server = make_server()
    control = Control(server.url)
    trajectory = control.create()
    client = sdk(trajectory)
    messages: list[Any] = [{"role": "user", "content": "look it up"}]
    dumped = []
    for _ in range(2):
        with client.chat.completions.stream(model="policy", messages=messages, tools=TOOLS_A) as s:
            message = s.get_final_completion().choices[0].message.model_dump()
        dumped.append(message)
        messages.append(message)
        if message["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": "call_0", "content": "found"})
    assert "parsed" in dumped[0] and "index" in dumped[0]["tool_calls"][0]
    samples = control.finish(trajectory["id"]).json()["samples"]
    assert len(samples) == 1 and samples[0]["messages"][-1]["content"] == "Found it."
    assert samples[0]["messages"][1]["reasoning_content"] == "let me look"
    control.close()

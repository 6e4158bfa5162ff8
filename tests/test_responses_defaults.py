"""The Responses dialect at Codex's defaults: tools declared in the input, namespace and
custom tools, custom tool calls, and items it does not read kept as sent (opaque)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
from codex_defaults import CALLED, EXEC_GRAMMAR, body, send
from server_fixtures import Control, ServerThread

from skycap.dialects import ReplyData
from skycap.dialects.responses import DIALECT
from skycap.dialects.responses_read import read_items, read_request
from skycap.dialects.responses_stream import read_response
from skycap.hashing import message_hash
from skycap.mock.replies import Reply
from skycap.mock.responses import ScriptedResponsesUpstream
from skycap.server.options import ServerOptions

WEB_SEARCH = {
    "id": "ws_1",
    "type": "web_search_call",
    "status": "completed",
    "action": {"type": "search", "query": "weather paris"},
}


def test_codex_default_body_reads_its_tools_and_messages() -> None:
    request = read_request(body())
    assert request.messages == [
        {"role": "developer", "content": "You are Codex, an agent based on GPT-6."},
        {"role": "user", "content": "say hi"},
    ]
    assert request.token_refusal is None
    assert [t["type"] for t in request.tools] == ["namespace"] * 3
    exec_tool = request.tools[0]["tools"][0]
    assert exec_tool == {
        "type": "custom",
        "custom": {
            "name": "exec",
            "description": "Run JavaScript code to orchestrate/compose tool calls",
            "format": {"type": "grammar", "syntax": "lark", "definition": EXEC_GRAMMAR},
        },
    }
    rendered = request.extras["token_tools"]
    assert [t["function"]["name"] for t in rendered] == CALLED
    exec_function = rendered[0]["function"]
    assert exec_function["parameters"]["required"] == ["input"]
    assert EXEC_GRAMMAR in exec_function["parameters"]["properties"]["input"]["description"]
    assert "omitted_tools" not in request.extras
    assert request.recorded["token_neutral"] == {
        "client_metadata": body()["client_metadata"],
        "prompt_cache_key": body()["prompt_cache_key"],
        "text.verbosity": "low",
        "reasoning.context": "all_turns",
    }


def test_token_neutral_fields_change_no_hash() -> None:
    plain = body()
    for key in ("client_metadata", "prompt_cache_key", "text"):
        del plain[key]
    plain["reasoning"] = {"effort": "low"}
    a, b = read_request(body()), read_request(plain)
    assert [message_hash(m) for m in a.messages] == [message_hash(m) for m in b.messages]
    assert a.tools == b.tools and "token_neutral" not in b.recorded


def test_custom_and_namespaced_calls_are_canonical_function_calls() -> None:
    output = [
        {"type": "custom_tool_call", "id": "ctc_1", "status": "completed", "call_id": "c1"}
        | {"name": "exec", "namespace": "functions", "input": 'console.log("hi")'},
        {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "sleep"}
        | {"namespace": "clock", "arguments": '{"duration_ms":5}'},
    ]
    message, reason, _ = read_response({"output": output, "status": "completed"})
    assert reason == "tool_calls"
    assert message["tool_calls"] == [
        {
            "id": "c1",
            "type": "function",
            "function": {
                "name": "functions.exec",
                "arguments": '{"input":"console.log(\\"hi\\")"}',
            },
        },
        {
            "id": "c2",
            "type": "function",
            "function": {"name": "clock.sleep", "arguments": '{"duration_ms":5}'},
        },
    ]
    results = [
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "hi"},
        {"type": "function_call_output", "call_id": "c2", "output": "slept"},
    ]
    replay = read_items([*output, *results])
    assert message_hash(replay[0]) == message_hash(message)
    assert replay[1:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "hi"},
        {"role": "tool", "tool_call_id": "c2", "content": "slept"},
    ]


def test_token_mode_answers_a_custom_tool_as_a_custom_tool_call() -> None:
    request = read_request(body())
    # What token mode's parser stores for `exec` called with its one argument.
    parsed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "functions.exec"}},
            {"id": "y", "type": "function", "function": {"name": "clock.sleep"}},
        ],
    }
    parsed["tool_calls"][0]["function"]["arguments"] = '{"input":"1+1"}'
    parsed["tool_calls"][1]["function"]["arguments"] = '{"duration_ms":1}'
    stored = DIALECT.issue(parsed, [1, 2])
    reply = ReplyData("resp_1", 1, "m", stored, "tool_calls", 5, 2, request)
    items = orjson.loads(DIALECT.reply_json(reply))["output"]
    assert [(i["type"], i.get("namespace"), i["name"]) for i in items] == [
        ("custom_tool_call", "functions", "exec"),
        ("function_call", "clock", "sleep"),
    ]
    assert items[0]["input"] == "1+1"
    (replayed,) = read_items(items)
    assert message_hash(replayed) == message_hash(stored)
    sse = DIALECT.reply_sse(reply)
    assert b"response.custom_tool_call_input.done" in sse


def test_unread_reply_items_stay_in_the_turn_and_replay_to_it() -> None:
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "E"}
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}
    answer["content"][0]["text"] = "Sunny."
    output = [reasoning, WEB_SEARCH, answer]
    message, reason, _ = read_response({"output": output, "status": "completed"})
    assert reason == "stop"
    assert message["content"] == [
        {"type": "opaque", "dialect": "responses", "value": WEB_SEARCH},
        {"type": "text", "text": "Sunny."},
    ]
    user = {"role": "user", "content": "weather?"}
    request = read_request({"input": [user, *output, {"role": "user", "content": "thanks"}]})
    assert message_hash(request.messages[1]) == message_hash(message)
    assert request.token_refusal is not None
    assert request.token_refusal.startswith("input[2] has type 'web_search_call'")


def test_unread_items_parts_and_roles_are_kept_as_sent() -> None:
    reference = {"type": "item_reference", "id": "msg_1"}
    part = {"type": "input_file", "file_id": "file_1"}
    critic = {"type": "message", "role": "critic", "content": "no"}
    search_output = {"type": "tool_search_output", "call_id": "ts_1", "tools": []}
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "read"}, part]},
        critic,
        reference,
        search_output,
        {"type": "compaction", "encrypted_content": "xyz"},
    ]
    request = read_request({"input": items})
    opaque = [{"type": "opaque", "dialect": "responses", "value": v} for v in items[1:]]
    assert request.messages == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "read"}, opaque[0] | {"value": part}],
        },
        {"role": "critic", "content": [opaque[0]]},
        {"role": "assistant", "content": [opaque[1]]},
        {"role": "opaque", "content": [opaque[2]]},
        {"role": "opaque", "content": [opaque[3]]},
    ]
    assert request.token_refusal is not None
    assert request.token_refusal.startswith("input[0].content[1] has type 'input_file'")
    compaction = read_request({"input": items[-1:]}).token_refusal
    assert compaction is not None and "remote compaction" in compaction


EXEC_CALL = {
    "type": "custom",
    "id": "call_e1",
    "namespace": "functions",
    "custom": {"name": "exec", "input": 'text("hi")'},
}


def codex_script(request: dict[str, Any]) -> Reply:
    """Call `exec` until its output comes back, then search the web and answer."""
    if "custom_tool_call_output" in orjson.dumps(request.get("input")).decode():
        return Reply(reasoning_content="Done.", hosted=[WEB_SEARCH], content="hi")
    return Reply(reasoning_content="Run it.", tool_calls=[EXEC_CALL])


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedResponsesUpstream]:
    with ScriptedResponsesUpstream(codex_script) as mock:
        yield mock


@pytest.fixture(scope="module")
def server(upstream: ScriptedResponsesUpstream) -> Iterator[ServerThread]:
    thread = ServerThread(ServerOptions(upstream.base_url, upstream_timeout=5.0))
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture
def control(server: ServerThread) -> Iterator[Control]:
    with Control(server.url) as client:
        yield client


def create(client: openai.OpenAI, sent: dict[str, Any]) -> dict[str, Any]:
    """One call with the body as Codex sends it; the response as a client sends it back."""
    return send(client, sent).model_dump(exclude_none=True)


def test_codex_at_its_defaults_is_forwarded_as_sent_and_recorded_as_one_path(
    control: Control, upstream: ScriptedResponsesUpstream
) -> None:
    trajectory = control.create()
    client = openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )
    first_body = body()
    first = create(client, first_body)
    assert orjson.loads(upstream.requests[-1].body) == first_body  # forwarded as sent
    (call,) = first["output"][1:]
    assert (call["type"], call["namespace"], call["name"]) == (
        "custom_tool_call",
        "functions",
        "exec",
    )
    second_body = body()
    second_body["input"] += [
        *first["output"],
        {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "hi"},
    ]
    second = create(client, second_body)
    assert orjson.loads(upstream.requests[-1].body) == second_body
    assert [item["type"] for item in second["output"]] == [
        "reasoning",
        "web_search_call",
        "message",
    ]
    third_body = body()
    del third_body["stream"]  # a JSON reply this time
    third_body["input"] += [
        *second_body["input"][3:],
        *second["output"],
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ok"}]},
    ]
    create(client, third_body)

    document = control.document(trajectory["id"]).json()
    calls = [c for node in document["nodes"] for c in node["calls"]]
    assert len(calls) == 3
    assert all(c["token_neutral"]["reasoning.context"] == "all_turns" for c in calls)
    (sample,) = control.finish(trajectory["id"]).json()["samples"]  # one path
    roles = [m["role"] for m in sample["messages"]]
    assert roles == ["developer", "user", "assistant", "tool", "assistant", "user", "assistant"]
    turn = sample["messages"][2]
    assert turn["tool_calls"][0]["function"]["name"] == "functions.exec"
    assert sample["messages"][4]["content"][0]["value"] == WEB_SEARCH

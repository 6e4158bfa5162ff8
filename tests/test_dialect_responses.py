"""Unit tests for the Responses dialect: reading requests, writing replies, assembling streams."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skycap.dialects import ReplyData, StreamError
from skycap.dialects.responses import DIALECT, responses_error
from skycap.dialects.responses_read import (
    RequestError,
    check_tool_results,
    decode_reasoning_token,
    read_items,
    read_request,
    token_refusal,
    with_history,
)
from skycap.dialects.responses_stream import ResponsesAssembler, read_response
from skycap.hashing import message_hash
from skycap.wire import BodyError

# A Codex CLI second call, trimmed (as it sends it: ids on every item, content: null or
# content parts on reasoning, statuses on calls).
CODEX_INPUT = [
    {
        "type": "message",
        "id": "msg_89e6",
        "role": "developer",
        "content": [{"type": "input_text", "text": "You are a coding agent."}],
    },
    {
        "type": "message",
        "id": "msg_01a2",
        "role": "user",
        "content": [{"type": "input_text", "text": "run echo hi"}],
    },
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "sum"}],
        "content": [{"type": "reasoning_text", "text": "think"}],
        "encrypted_content": "ENC1",
    },
    {
        "type": "function_call",
        "status": "completed",
        "id": "fc_1",
        "name": "exec_command",
        "arguments": '{"cmd": "echo hi"}',
        "call_id": "call_1",
    },
    {"type": "function_call_output", "id": "fco_x", "call_id": "call_1", "output": "hi\n"},
]
TOOLS = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object"}, "strict": False},
    {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": []},
    {"type": "web_search"},
    {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
]


def test_codex_input_reads_into_chat_messages() -> None:
    request = read_request(
        {"model": "m", "input": CODEX_INPUT, "tools": TOOLS, "stream": True, "store": False}
    )
    assert request.messages == [
        {"role": "developer", "content": "You are a coding agent."},
        {"role": "user", "content": "run echo hi"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "think",
            "reasoning_items": [
                {
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "sum"}],
                    "encrypted_content": "ENC1",
                }
            ],
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd": "echo hi"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "hi\n"},
    ]
    assert request.stream and request.token_refusal is None
    function = {
        "type": "function",
        "function": {"name": "exec_command", "parameters": {"type": "object"}, "strict": False},
    }
    custom = {"type": "custom", "custom": {"name": "apply_patch", "format": {"type": "grammar"}}}
    assert request.tools == [function, TOOLS[1], TOOLS[2], custom]  # other kinds as sent
    assert [t["function"]["name"] for t in request.extras["token_tools"]] == [
        "exec_command",
        "apply_patch",
    ]
    assert request.extras["omitted_tools"] == ["web_search"]
    check_tool_results(request.messages)


def test_string_input_instructions_and_sampling() -> None:
    body = {"input": "hi", "instructions": "Be brief.", "max_output_tokens": 50, "top_p": 0.9}
    request = read_request(body | {"previous_response_id": "resp_1"})
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert request.sampling == {"max_tokens": 50, "top_p": 0.9}
    assert request.recorded == {"previous_response_id": "resp_1", "instructions": True}
    previous = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert with_history(request, previous) == [request.messages[0], *previous, request.messages[1]]


def test_text_parts_follow_the_chat_shape_and_images_need_text_mode() -> None:
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    assert read_items([{"role": "user", "content": parts}])[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}
    message = {"role": "user", "content": [image]}
    assert read_items([message])[0]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}
    ]
    assert "token mode renders text only" in token_refusal({}, read_items([message]), [])


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ([], None, "must be a JSON object"),
        ({"input": 3}, "input", "string or a list of items"),
        ({"input": [{"role": 7, "content": "x"}]}, "input[0].role", "must be a string"),
        ({"input": [{"type": "message", "content": "x"}]}, "input[0].role", "without a `role`"),
        (
            {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "exec"}]},
            "input[0]",
            "`input`",
        ),
        ({"input": "x", "tools": [{"type": "custom"}]}, "tools[0].name", "without a `name`"),
        (
            {"input": [{"type": "additional_tools", "role": "developer", "tools": {}}]},
            "input[0].tools",
            "list of objects",
        ),
        ({"input": "x", "background": True}, "background", "background responses"),
        ({"input": "x", "previous_response_id": 7}, "previous_response_id", "response id"),
        ({"input": "x", "stream": "yes"}, "stream", "boolean"),
        ({"input": "x", "tools": [{"name": "f"}]}, "tools[0].type", "no string `type`"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
            "input[0]",
            "`name`",
        ),
    ],
)
def test_bad_requests_name_the_field(body: Any, param: str | None, match: str) -> None:
    with pytest.raises(RequestError, match=match) as caught:
        read_request(body)
    assert caught.value.param == param


def test_token_mode_refusals() -> None:
    body = {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}
    assert "text.format type 'json_schema'" in token_refusal(body, [], [])
    assert token_refusal({"input": "x", "text": {"format": {"type": "text"}}}, [], []) is None
    conversation = read_request({"input": "x", "conversation": "conv_1"}).token_refusal
    assert conversation is not None and conversation.startswith("conversations are not")


def test_tool_output_without_its_call_is_refused() -> None:
    messages = read_items([{"type": "function_call_output", "call_id": "call_9", "output": "x"}])
    with pytest.raises(RequestError, match="'call_9', which matches no function_call"):
        check_tool_results(messages)


def reply_for(message: dict[str, Any], reason: str = "stop", **body: Any) -> ReplyData:
    return ReplyData(
        id="resp_abc",
        created=1,
        model="m",
        message=message,
        finish_reason=reason,
        prompt_tokens=10,
        completion_tokens=7,
        request=read_request({"model": "m", "input": "q", **body}),
        reasoning_tokens=3,
    )


PARSED = {
    "role": "assistant",
    "content": "Let me check.",
    "reasoning_content": "The user wants the weather.",
    "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    ],
}
STORED = DIALECT.issue(PARSED, [1, 2, 3])


def test_written_reply_reads_back_to_the_stored_message() -> None:
    body = orjson.loads(DIALECT.reply_json(reply_for(STORED)))
    assert STORED["reasoning_items"][0]["id"] == body["output"][0]["id"]
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]
    call_id = STORED["tool_calls"][0]["id"]
    assert call_id != "call_abc" and call_id.startswith("call_")  # issued fresh
    assert body["output"][2]["call_id"] == call_id
    assert DIALECT.issue(PARSED, [1, 2, 3])["tool_calls"][0]["id"] != call_id
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    # A client that drops the reasoning text but keeps encrypted_content (as OpenAI's own
    # reasoning items are replayed) still reads back the exact reasoning.
    replayed = [dict(item) for item in body["output"]]
    replayed[0]["content"] = None
    (message,) = read_items(replayed)
    assert message["reasoning_content"] == STORED["reasoning_content"]
    assert {k: message[k] for k in ("content", "tool_calls")} == {
        k: STORED[k] for k in ("content", "tool_calls")
    }
    digest, text = decode_reasoning_token(body["output"][0]["encrypted_content"])
    assert text == STORED["reasoning_content"] and len(digest) == 32
    with pytest.raises(RequestError, match="was altered"):
        read_items([{**replayed[0], "encrypted_content": "skycap.r1.!!"}])


def test_sse_and_json_agree_and_length_is_incomplete() -> None:
    reply = reply_for({"role": "assistant", "content": "partial"}, "length", max_output_tokens=3)
    body = orjson.loads(DIALECT.reply_json(reply))
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["max_output_tokens"] == 3
    sse = DIALECT.reply_sse(reply)
    events = [orjson.loads(line[6:]) for line in sse.split(b"\n") if line[:6] == b"data: "]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"] == body


def test_assembler_reads_a_split_stream_like_the_json() -> None:
    reply = reply_for(STORED)
    stream = DIALECT.reply_sse(reply)
    assembler = ResponsesAssembler()
    for i in range(0, len(stream), 7):
        assembler.feed(stream[i : i + 7])
    assert assembler.finish_seen and assembler.done and assembler.reply_id == reply.id
    message, reason = assembler.result()
    body = orjson.loads(DIALECT.reply_json(reply))
    json_message, json_reason, json_usage = read_response(body)
    assert message == json_message and reason == json_reason == "tool_calls"
    assert assembler.usage == json_usage
    # Text mode hashes the reply and its replay the same way.
    (replayed,) = read_items(body["output"])
    assert message_hash(replayed) == message_hash(message)


def test_failed_stream_is_not_a_reply() -> None:
    assembler = ResponsesAssembler()
    failed = {"type": "response.failed", "sequence_number": 3}
    failed["response"] = {"id": "resp_1", "status": "failed", "error": {"message": "boom"}}
    assembler.feed(b"data: " + orjson.dumps(failed) + b"\n\n")
    assert assembler.finish_seen
    with pytest.raises(StreamError, match="boom"):
        assembler.result()


def test_error_body_shapes() -> None:
    body = orjson.loads(responses_error(404, "no such response", None, "previous_response_id"))
    assert body == {
        "error": {
            "message": "no such response",
            "type": "not_found_error",
            "param": "previous_response_id",
            "code": None,
        }
    }
    assert orjson.loads(responses_error(502, "x"))["error"]["type"] == "api_error"


_TOOL_KEYS = st.dictionaries(
    st.sampled_from(["description", "strict", "parameters", "defer_loading"]),
    st.none() | st.booleans() | st.text(max_size=3) | st.just({"type": "object"}),
    max_size=4,
)


@given(st.lists(st.tuples(_TOOL_KEYS, st.booleans(), st.text(max_size=3)), max_size=4))
def test_a_function_tool_reads_as_its_members_under_function(tools: list) -> None:
    """A function tool is a Chat Completions function of every member but `type`, in the
    order sent, recorded and rendered alike; one without a name is refused (the same
    reading a namespace's members take, qualified)."""
    sent = [
        ({"type": "function", "name": name} | keys)
        if typed_first
        else (keys | {"name": name, "type": "function"})
        for keys, typed_first, name in tools
    ]
    if not all(name for _, _, name in tools):
        with pytest.raises(BodyError, match="function tool without a `name`"):
            DIALECT.read({"input": "hi", "tools": sent})
        return
    expected = [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        for tool in sent
    ]
    request = DIALECT.read({"input": "hi", "tools": sent})
    assert orjson.dumps(request.tools or []) == orjson.dumps(expected)  # the order of keys too
    assert request.extras.get("token_tools", expected) == expected
    namespaced = DIALECT.read(
        {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": sent}]}
    )
    rendered = namespaced.extras["token_tools"] or []
    assert [t["function"] | {"name": t["function"]["name"][3:]} for t in rendered] == [
        t["function"] for t in expected
    ]

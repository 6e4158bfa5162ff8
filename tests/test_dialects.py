"""The dialect layer without a server: canonical reading, writers, assemblers, errors."""

from __future__ import annotations

import random

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skycap.dialects import ReplyData, StreamError
from skycap.dialects.chat import DIALECT as CHAT
from skycap.dialects.chat import read_message
from skycap.dialects.messages import DIALECT as MESSAGES
from skycap.dialects.messages import anthropic_error
from skycap.dialects.responses import DIALECT as RESPONSES
from skycap.hashing import message_hash
from skycap.wire import BodyError

CALL = {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}


def test_chat_folds_token_neutral_spellings() -> None:
    request = CHAT.read(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
                {
                    "role": "assistant",
                    "content": "ok",
                    "reasoning": "because",
                    "parsed": None,
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}", "parsed_arguments": None},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
                    ],
                },  # fmt: skip
            ]
        }
    )
    user, assistant, several = request.messages
    assert user == {"role": "user", "content": "hi"}
    assert assistant == {
        "role": "assistant",
        "content": "ok",
        "reasoning_content": "because",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert several["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    both = CHAT.read(
        {"messages": [{"role": "assistant", "reasoning_content": "x", "reasoning": "x"}]}
    )
    assert both.messages[0] == {"role": "assistant", "reasoning_content": "x"}


def test_messages_reads_system_tools_results_thinking_and_images() -> None:
    request = MESSAGES.read(
        {
            "model": "claude",
            "max_tokens": 10,
            "temperature": 0.5,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab12;"},
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": {}}],
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "system", "content": [{"type": "text", "text": "env"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s1"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "calling", "citations": None},
                        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "bad",
                            "is_error": True,
                        },  # fmt: skip
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        },  # fmt: skip
                        {"type": "text", "text": "look"},
                    ],
                },
            ],
        }
    )
    system, user, env, assistant, tool, image = request.messages
    assert system == {"role": "system", "content": "Be brief."}
    assert (user["content"], env) == ("go", {"role": "system", "content": "env"})
    assert assistant == {
        "role": "assistant",
        "content": "calling",
        "reasoning_content": "hm",
        "thinking_blocks": [
            {"type": "thinking", "thinking": "hm", "signature": "s1"},
            {"type": "redacted_thinking", "data": "opaque"},
        ],
        "tool_calls": [CALL],
    }
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "bad", "is_error": True}
    assert image["content"][0] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AA=="},
    }
    assert request.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert request.sampling == {"max_tokens": 10, "temperature": 0.5}
    assert request.token_refusal is not None and "images" in request.token_refusal


@given(st.text(max_size=8) | st.sampled_from(["x-anthropic-billing-header: cch=1;", ""]))
def test_a_messages_string_content_reads_as_its_one_text_block(text: str) -> None:
    """A string is read directly, the way its one text block is read (user, assistant and
    system turns, and the top-level system), so both spellings land on one node. (An
    empty top-level `system` string is no system message at all, which is not compared.)"""

    def read(content: object) -> list[dict]:
        body = {
            "max_tokens": 8,
            "system": content if text else None,
            "messages": [
                {"role": "system", "content": content},
                {"role": "user", "content": content},
                {"role": "assistant", "content": content},
                {"role": "user", "content": "next"},
            ],
        }
        return MESSAGES.read(body).messages

    assert read(text) == read([{"type": "text", "text": text}])


_CHAT_MESSAGE = st.dictionaries(
    st.sampled_from(["role", "name", "tool_call_id", "reasoning", "reasoning_content", "parsed"]),
    st.text(max_size=4) | st.none(),
    max_size=4,
) | st.fixed_dictionaries({}, optional={"tool_calls": st.none() | st.just([dict(CALL, index=0)])})


@given(st.lists(st.tuples(_CHAT_MESSAGE, st.text(max_size=4) | st.none()), max_size=4))
def test_a_chat_message_read_in_a_few_steps_is_what_the_full_reading_makes(
    messages: list,
) -> None:
    """A message of a string content and keys that need nothing folded or dropped is read
    as a copy: each is what read_message makes of it."""
    sent = [{**keys, "content": text} for keys, text in messages]
    read = CHAT.read({"messages": sent}).messages
    assert read == [read_message(m, f"messages[{i}]", []) for i, m in enumerate(sent)]
    assert all(r is not m for r, m in zip(read, sent, strict=True))


_ITEM = st.tuples(
    st.sampled_from(["user", "system", "developer", "assistant", "call"]),
    st.booleans(),  # whether the item says `"type": "message"`
    st.sampled_from(["input_text", "output_text", "text"]),
    st.text(max_size=6),
)


@given(st.lists(_ITEM, max_size=6))
def test_a_responses_plain_text_message_reads_as_the_part_rules_read_it(items: list) -> None:
    """A message item whose content is a string or one text part is read in a few steps;
    a refusal part, which only the part-by-part rules read, holds those steps to the rules:
    the three spellings read as the same messages, assistant runs joined alike."""

    def read(spell: object) -> list[dict]:
        spelled = []
        for i, (role, typed, part, text) in enumerate(items):
            if role == "call":  # a tool result, which ends an assistant run
                spelled.append({"type": "function_call_output", "call_id": f"c{i}", "output": text})
                continue
            item = {"type": "message"} if typed else {}
            spelled.append(item | {"role": role, "content": spell(part, text), "id": f"m{i}"})
        body = {"model": "p", "input": spelled}
        return RESPONSES.read(body).messages

    as_string = read(lambda part, text: text)
    assert as_string == read(lambda part, text: [{"type": part, "text": text, "annotations": []}])
    assert as_string == read(lambda part, text: [{"type": "refusal", "refusal": text}])


@pytest.mark.parametrize(
    ("body", "refusal"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "`max_tokens` is required"),
        ({"max_tokens": 5, "stop_sequences": ["X"], "messages": []}, None),
        (
            {"max_tokens": 5, "tools": [{"type": "bash_20250124", "name": "bash"}], "messages": []},
            "server tool",
        ),  # fmt: skip
        ({"max_tokens": 5, "messages": [{"role": "assistant", "content": "pre"}]}, "prefill"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, None),
    ],
)
def test_what_token_mode_refuses_is_named_at_read_time(body: dict, refusal: str | None) -> None:
    request = MESSAGES.read(body)
    if refusal is None:
        assert request.token_refusal is None
    else:
        assert request.token_refusal is not None and refusal in request.token_refusal
    if "stop_sequences" in body:
        assert request.sampling["stop"] == ["X"]  # token mode applies it as a stop string


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ([], "must be a JSON object"),
        ({"max_tokens": 0, "messages": []}, "`max_tokens` must be a positive integer"),
        ({"messages": [{"role": "user", "content": 7}]}, "must be a string or a list of blocks"),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]},
            "needs a string `id`",
        ),  # fmt: skip
        ({"tools": [{"input_schema": {}}], "messages": []}, "`tools[0].name`"),
        ({"stop_sequences": "END", "messages": []}, "`stop_sequences` must be a list"),
        (
            {"stop_sequences": ["END", ""], "messages": []},
            "`stop_sequences[1]` must be a non-empty",
        ),
    ],
)
def test_malformed_messages_requests_are_body_errors(body: object, needle: str) -> None:
    with pytest.raises(BodyError) as refused:
        MESSAGES.read(body)
    assert needle in str(refused.value)


def _split(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), 25))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def test_a_token_mode_answer_reads_back_as_the_stored_message() -> None:
    """issue() -> JSON / SSE -> the client's replay or text-mode assembly: one message."""
    parsed = {
        "role": "assistant",
        "content": "Let me look. é🙂",
        "reasoning_content": "think",
        "tool_calls": [
            {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],
    }
    stored = MESSAGES.issue(parsed, [1, 2, 3])
    assert stored["tool_calls"][0]["id"].startswith("toolu_")
    assert stored["thinking_blocks"][0]["signature"].startswith("skycap-")
    reply = ReplyData("msg_1", 0, "m", {**stored, "reasoning": "think"}, "tool_calls", 7, 5)
    answer = orjson.loads(MESSAGES.reply_json(reply))
    assert answer["stop_reason"] == "tool_use" and answer["usage"]["input_tokens"] == 7
    replay = MESSAGES.read({"messages": [{"role": "assistant", "content": answer["content"]}]})
    assert message_hash(replay.messages[0]) == message_hash(stored)
    for seed in range(5):
        assembler = MESSAGES.assembler()
        for piece in _split(MESSAGES.reply_sse(reply), seed):
            assembler.feed(piece)
        assert assembler.done and assembler.finish_seen
        message, finish = assembler.result()
        assert (message_hash(message), finish) == (message_hash(stored), "tool_calls")
        assert assembler.usage == {**answer["usage"], "output_tokens": 5}


def test_a_chat_answer_with_both_reasoning_keys_assembles_to_reasoning_content() -> None:
    message = {"role": "assistant", "content": "ok", "reasoning_content": "r", "reasoning": "r"}
    reply = ReplyData("chatcmpl-1", 0, "m", message, "stop", 3, 2)
    assembler = CHAT.assembler()
    assembler.feed(CHAT.reply_sse(reply))
    assert assembler.result() == (
        {"role": "assistant", "content": "ok", "reasoning_content": "r"},
        "stop",
    )


def test_a_messages_stream_without_a_stop_reason_names_the_reported_error() -> None:
    assembler = MESSAGES.assembler()
    assembler.feed(
        b'event: message_start\ndata: {"type": "message_start", "message": {"usage": {}}}\n\n'
        b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error"}}\n\n'
    )
    with pytest.raises(StreamError, match="no stop_reason.*overloaded_error"):
        assembler.result()


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
     (404, "not_found_error"), (410, "invalid_request_error"), (413, "request_too_large"),
     (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (529, "overloaded_error")],
)  # fmt: skip
def test_anthropic_error_types_follow_the_status(status: int, kind: str) -> None:
    body = orjson.loads(anthropic_error(status, "why", "code_x"))
    assert body == {"type": "error", "error": {"type": kind, "message": "why", "code": "code_x"}}


@pytest.mark.parametrize(
    ("field", "keys"),
    [
        ("both", {"reasoning_content", "reasoning"}),
        ("reasoning_content", {"reasoning_content"}),
        ("reasoning", {"reasoning"}),
    ],
)
def test_reasoning_field_picks_the_reply_keys(field: str, keys: set[str]) -> None:
    from skycap.tokens.reply import answered_message

    stored = {"role": "assistant", "content": "ok", "reasoning_content": "r"}
    answered = answered_message(stored, use_raw_content=False, reasoning_field=field)
    assert {k for k in answered if k.startswith("reasoning")} == keys
    assert all(answered[k] == "r" for k in keys) and stored["reasoning_content"] == "r"
    replay = CHAT.read({"messages": [answered]}).messages[0]
    assert message_hash(replay) == message_hash(stored)  # either key folds back


def test_reasoning_field_is_checked_by_the_options() -> None:
    from skycap.server.options import ServerOptions

    with pytest.raises(ValueError, match=r"reasoning_field \(--reasoning-field\) must be one of"):
        ServerOptions("http://e:8000", reasoning_field="thinking")
    with pytest.raises(ValueError, match=r"upstream_auth \(--upstream-auth\) must be one of"):
        ServerOptions("http://e:8000/v1", upstream_auth="basic")

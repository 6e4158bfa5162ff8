"""Tests for incremental SSE stream assembly (skycap.dialects.chat, http.md §3.1)."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from skycap.dialects.chat import StreamAssembler, StreamError

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return HEAD | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]} | extra


def sse(*payloads: Any, sep: bytes = b"\n") -> bytes:
    out = b""
    for payload in payloads:
        data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        out += b"data: " + data + sep + sep
    return out


REALISTIC = [
    chunk({"role": "assistant", "content": None}, usage=None),
    chunk({"reasoning": "Let me "}),
    chunk({"reasoning": "think. é🙂"}),
    chunk({"content": "Calling "}),
    chunk({"content": "tools."}),
    chunk(
        {
            "tool_calls": [
                {"index": 1, "id": "call_b", "type": "function", "function": {"name": "lo"}}
            ]
        }
    ),
    chunk({"tool_calls": [{"id": "call_a", "function": {"name": "get_", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": None, "function": {"name": "weather", "arguments": '{"ci'}}]}),
    chunk({"tool_calls": [{"index": 1, "function": {"name": "ok", "arguments": "{}"}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}),
    chunk({}, "tool_calls"),
    HEAD | {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 7}},
    b"[DONE]",
]

EXPECTED = {
    "role": "assistant",
    "content": "Calling tools.",
    "reasoning_content": "Let me think. é🙂",
    "tool_calls": [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_b", "type": "function", "function": {"name": "look", "arguments": "{}"}},
    ],
}


def assemble(parts: list[bytes]) -> StreamAssembler:
    assembler = StreamAssembler()
    for part in parts:
        assembler.feed(part)
    return assembler


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


@pytest.mark.parametrize("sep", [b"\n", b"\r\n"])
def test_realistic_stream_is_identical_over_any_split(sep: bytes) -> None:
    data = sse(*REALISTIC, sep=sep)
    rng = random.Random(7)
    splits = [
        [data],
        [data[i : i + 1] for i in range(len(data))],
        *(split_at(data, rng.sample(range(1, len(data)), k)) for k in (3, 17, 200)),
    ]
    if sep == b"\r\n":  # cut between every CR and its LF
        splits.append(split_at(data, [i + 1 for i in range(len(data)) if data[i] == 13]))
    for parts in splits:
        assembler = assemble(parts)
        assert assembler.result() == (EXPECTED, "tool_calls")
        assert assembler.usage == {"prompt_tokens": 10, "completion_tokens": 7}
        assert assembler.done


def test_finish_seen_turns_on_with_the_chunk_holding_the_finish_reason() -> None:
    """The relay holds chunks back from the first one in which finish_reason appears."""
    events = [sse(payload) for payload in REALISTIC]
    finish_event = next(
        i
        for i, p in enumerate(REALISTIC)
        if isinstance(p, dict) and p["choices"] and p["choices"][0]["finish_reason"]
    )
    # Split the finish event in two: the flag turns on only once the event is complete.
    first_half = events[finish_event][: len(events[finish_event]) // 2]
    second_half = events[finish_event][len(first_half) :]
    parts = [*events[:finish_event], first_half, second_half, *events[finish_event + 1 :]]
    assembler = StreamAssembler()
    flags = []
    for part in parts:
        assembler.feed(part)
        flags.append(assembler.finish_seen)
    held_from = flags.index(True)
    assert parts[held_from] is second_half
    assert all(flags[held_from:])


def test_multiline_data_comments_and_other_fields() -> None:
    data = (
        b": keep-alive comment\n\n"
        b"event: message\nid: 1\n"
        b'data: {"choices": [{"index": 0,\n'
        b'data:  "delta": {"content": "a"}}]}\n\n'
        b'data:{"choices":[{"delta":{"content":"b"},"finish_reason":"stop"}]}\n\n'
        b"retry: 10\n\n"
    )
    assembler = assemble([data])
    assert assembler.result() == ({"role": "assistant", "content": "ab"}, "stop")
    assert not assembler.done


def test_lone_cr_separators_count_as_line_ends() -> None:
    data = sse(chunk({"content": "x"}, "length"), b"[DONE]", sep=b"\r")
    assembler = assemble([data, b"\n"])  # a final CR may be half of a CRLF: it needs a next byte
    assert assembler.result() == ({"role": "assistant", "content": "x"}, "length")
    assert assembler.done


def test_usage_last_wins_and_null_usage_is_ignored() -> None:
    data = sse(
        chunk({"content": "x"}, usage={"completion_tokens": 1}),
        chunk({}, "stop", usage={"completion_tokens": 2}),
        chunk({}, usage=None),
    )
    assert assemble([data]).usage == {"completion_tokens": 2}
    assert StreamAssembler().usage is None


def test_reasoning_content_wins_over_its_alias_in_one_delta() -> None:
    data = sse(
        chunk({"reasoning_content": "a", "reasoning": "a"}),
        chunk({"reasoning": "b", "reasoning_content": None}),
        chunk({}, "stop"),
    )
    message, _ = assemble([data]).result()
    assert message == {"role": "assistant", "content": None, "reasoning_content": "ab"}


def test_content_null_unless_a_string_arrived_and_role_is_taken() -> None:
    only_empty = sse(chunk({"role": "tool", "content": ""}), chunk({}, "stop"))
    assert assemble([only_empty]).result()[0] == {"role": "tool", "content": ""}
    nothing = sse(chunk({"content": None}), chunk({}, "stop"))
    assert assemble([nothing]).result()[0] == {"role": "assistant", "content": None}


def test_last_non_empty_finish_reason_wins() -> None:
    data = sse(chunk({}, "length"), chunk({}, "stop"), chunk({}, ""), chunk({}, None))
    assert assemble([data]).result()[1] == "stop"


def test_result_is_the_first_choice() -> None:
    second = HEAD | {"choices": [{"index": 1, "delta": {"content": "B"}, "finish_reason": "stop"}]}
    first = HEAD | {"choices": [{"index": 0, "delta": {"content": "A"}, "finish_reason": "stop"}]}
    assert assemble([sse(second, first)]).result()[0]["content"] == "A"


def test_events_after_done_and_an_unterminated_last_event_are_ignored() -> None:
    done_then_more = sse(chunk({"content": "a"}, "stop"), b"[DONE]", chunk({"content": "z"}))
    assembler = assemble([done_then_more])
    assert assembler.result()[0]["content"] == "a"
    unterminated = sse(chunk({"content": "a"}, "stop")) + b'data: {"choices": []}\n'
    assert assemble([unterminated]).result()[0]["content"] == "a"


def test_no_finish_reason_is_unreadable() -> None:
    assembler = assemble([sse(chunk({"content": "partial"}), b"[DONE]")])
    with pytest.raises(StreamError, match=r"^unreadable stream: no finish_reason in 1 JSON events"):
        assembler.result()
    with pytest.raises(StreamError, match="no \\[DONE\\] before the end"):
        StreamAssembler().result()


def test_an_error_event_is_quoted_when_no_finish_reason_came() -> None:
    assembler = assemble([sse({"error": {"message": "engine crashed"}})])
    with pytest.raises(StreamError, match="the stream reported an error: .*engine crashed"):
        assembler.result()


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        (b"<html>", "a data payload is not JSON"),
        (b"[1, 2]", "a data payload is not a JSON object"),
        (b'{"choices": {"index": 0}}', "`choices` is not a list of objects"),
    ],
)
def test_bad_payload_is_unreadable_and_feed_never_raises(payload: bytes, detail: str) -> None:
    assembler = StreamAssembler()
    assembler.feed(sse(payload))
    assembler.feed(sse(chunk({"content": "x"}, "stop")))
    with pytest.raises(StreamError, match=f"^unreadable stream: {detail}"):
        assembler.result()

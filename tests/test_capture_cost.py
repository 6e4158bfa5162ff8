"""The shortcuts that make text-mode capture cheaper give what the full work gives.

Each is a faster path to a value the slower one defines: remembered hashes to the
recipes of skycap.hashing, events passed by unparsed to the reply their terminal event
carries, header reads over raw fields to mitmproxy's, and the upstream client's framing
reads to mitmproxy's rules (docs/performance.md "Against a minimal aiohttp relay").
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.net.http import http1

from skycap.dialects import chat, responses
from skycap.dialects import messages as messages_dialect
from skycap.dialects.messages_stream import MessagesAssembler
from skycap.dialects.responses_stream import ResponsesAssembler
from skycap.dialects.sse import StreamError
from skycap.hashing import Remembered, text_match, tools_hash
from skycap.mock.replies import Reply
from skycap.mock.responses import response_object, stream_events
from skycap.server import messages
from skycap.server.keys import text_header
from skycap.server.upstream import _body_size, _closes
from skycap.text.commit import commit_text_call
from skycap.trajectory import Trajectory
from skycap.weights import reported_spans

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
MESSAGES = st.dictionaries(
    st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id", "x"]),
    JSON_VALUES,
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(MESSAGES, min_size=1, max_size=4), st.sampled_from(["", "t1"]), JSON_VALUES)
def test_remembered_hashes_are_the_recipes(
    conversation: list[dict[str, Any]], tools_key: str, tools: Any
) -> None:
    remembered = Remembered()
    for _ in range(2):  # the second pass answers from memory
        for message in conversation:
            assert remembered.text_match(message, tools_key, "p") == text_match(
                message, tools_key, "p"
            )
        assert remembered.tools_hash(tools) == tools_hash(tools)
    # 1 and True are equal in Python and in a dict key, but not in canonical JSON.
    assert remembered.text_match({"content": 1}, "", "p") != remembered.text_match(
        {"content": True}, "", "p"
    )


def _record(trajectory: Trajectory) -> bytes:
    return orjson.dumps(
        [(n.id, n.parent, n.message, n.match_hash, n.delta_hash, n.calls) for n in trajectory.graph]
    )


def test_a_commit_with_remembered_hashes_is_the_commit_without() -> None:
    calls = [
        ([{"role": "user", "content": "a"}], {"role": "assistant", "content": "b"}),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            {"role": "assistant", "content": "c"},
        ),
        ([{"role": "user", "content": "other"}], {"role": "assistant", "content": "d"}),
    ]
    plain = Trajectory("t-plain", capture={"mode": "text"})
    cached = Trajectory("t-cached", capture={"mode": "text"})
    remembered = Remembered()
    for conversation, reply in calls:
        request = responses.DIALECT.read({"model": "p", "input": conversation, "tools": []})
        call = {"t_start": 1.0, "t_end": 2.0, "sampling": {}}
        commit_text_call(plain, request, reply, dict(call))
        commit_text_call(cached, request, reply, dict(call), remembered)
    assert _record(plain) == _record(cached)
    assert plain.tools == cached.tools


def _responses_stream(**reply: Any) -> list[bytes]:
    response = response_object(Reply(**reply), {}, response_id="resp_1", number=0, request_size=9)
    return stream_events(response)


def _truncated(event: bytes) -> bytes:
    """The event with its JSON cut short: unreadable if parsed."""
    return event.replace(b"}\n\n", b"\n\n")


def test_responses_deltas_pass_by_and_the_reply_is_the_terminal_events() -> None:
    events = _responses_stream(content="one two three four")
    assembler = ResponsesAssembler()
    for event in events:  # a delta unparsed is not looked at: even a broken one
        assembler.feed(_truncated(event) if b"output_text.delta" in event else event)
    message, reason = assembler.result()
    assert message == {"role": "assistant", "content": "one two three four"}
    assert reason == "stop"


def test_a_failure_event_numbers_after_the_last_delta_passed_by() -> None:
    events = _responses_stream(content="one two three four")
    cut = next(i for i, e in enumerate(events) if b"output_text.done" in e)
    assembler = ResponsesAssembler()
    for event in events[:cut]:  # ends with deltas, which are not parsed
        assembler.feed(event)
    last = orjson.loads(events[cut - 1].split(b"data: ", 1)[1])
    assert last["type"] == "response.output_text.delta"
    assert assembler.sequence == last["sequence_number"]
    failure = responses.DIALECT.stream_failure(assembler, "cut")
    failed = orjson.loads(failure.split(b"data: ", 1)[1])
    assert failed["sequence_number"] == last["sequence_number"] + 1


def _with_terminal(events: list[bytes], **changes: Any) -> list[bytes]:
    """`events` with the terminal event's response changed (keys set to None removed)."""
    head, payload = events[-1].split(b"data: ", 1)
    terminal = orjson.loads(payload)
    response = {**terminal["response"], **changes}
    terminal["response"] = {k: v for k, v in response.items() if v is not None}
    return [*events[:-1], head + b"data: " + orjson.dumps(terminal) + b"\n\n"]


def _kept(event: bytes) -> bool:
    return any(name in event for name in (b"response.created", b"in_progress", b"item.done"))


def test_responses_opening_and_item_events_are_parsed_only_when_needed() -> None:
    events = _responses_stream(
        content="one two", tool_calls=[{"function": {"name": "f", "arguments": "{}"}}]
    )
    whole = ResponsesAssembler()
    for event in events:
        whole.feed(event)
    expected = whole.result()
    assert expected[0]["tool_calls"] and expected[1] == "tool_calls"

    broken = ResponsesAssembler()  # the terminal event has it all: the rest is not looked at
    for event in events:
        broken.feed(_truncated(event) if _kept(event) else event)
    assert broken.result() == expected and broken.reply_id == "resp_1"

    standing_in = ResponsesAssembler()  # no output, no id: the items and announced id stand in
    for event in _with_terminal(events, output=[], id=None):
        standing_in.feed(event)
    assert standing_in.result() == expected and standing_in.reply_id == "resp_1"

    needed = ResponsesAssembler()
    for event in _with_terminal(events, output=[]):
        needed.feed(_truncated(event) if b"item.done" in event else event)
    with pytest.raises(StreamError, match="no output and a response.output_item.done payload"):
        needed.result()


def test_a_cut_responses_stream_fails_as_the_response_it_announced() -> None:
    events = _responses_stream(content="one two three four")
    cut = len(events) - 1  # the last event before the terminal one is an item's done
    assert b"response.output_item.done" in events[cut - 1]
    assembler = ResponsesAssembler()
    for event in events[:cut]:
        assembler.feed(event)
    with pytest.raises(StreamError, match="no response.completed"):
        assembler.result()
    failure = orjson.loads(responses.DIALECT.stream_failure(assembler, "cut").split(b"data: ")[1])
    announced = orjson.loads(events[1].split(b"data: ", 1)[1])["response"]
    assert failure["sequence_number"] == cut
    assert failure["response"] == {
        **announced,
        "status": "failed",
        "error": {"code": "server_error", "message": "cut"},
    }


@pytest.mark.parametrize("terminal_spans", [None, [{"version": "8", "start": 0, "end": 2}]])
def test_spans_on_an_opening_event_are_read_and_a_later_events_win(terminal_spans: Any) -> None:
    spans = [{"version": "7", "start": 0, "end": 2}]
    events = _with_terminal(_responses_stream(content="one two"), weight_versions=terminal_spans)
    head, payload = events[0].split(b"data: ", 1)
    created = orjson.loads(payload)
    created["response"]["weight_versions"] = spans
    assembler = ResponsesAssembler()
    for event in [head + b"data: " + orjson.dumps(created) + b"\n\n", *events[1:]]:
        assembler.feed(event)
    assembler.result()
    assert assembler.weight_versions == (terminal_spans or spans)


def test_an_event_without_a_name_is_read() -> None:
    """Only a named event can be passed by: without `event:` lines every event is parsed."""
    events = [e.split(b"\n", 1)[1] for e in _responses_stream(content="hi")]
    broken = [_truncated(e) if b"output_text.delta" in e else e for e in events]
    assembler = ResponsesAssembler()
    for event in broken:
        assembler.feed(event)
    with pytest.raises(StreamError, match="not JSON"):
        assembler.result()


def test_messages_pings_pass_by() -> None:
    stream = [
        b'event: message_start\ndata: {"type":"message_start",'
        b'"message":{"usage":{"input_tokens":3}}}\n\n',
        b"event: ping\ndata: not even JSON\n\n",
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"hi"}}\n\n',
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
        b'"usage":{"output_tokens":1}}\n\n',
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ]
    assembler = MessagesAssembler(lambda blocks, stop: ({"blocks": blocks}, stop))
    for event in stream:
        assembler.feed(event)
    reply, stop = assembler.result()
    assert stop == "end_turn" and reply["blocks"][0]["text"] == "hi"
    assert assembler.usage == {"input_tokens": 3, "output_tokens": 1}


@pytest.mark.parametrize(
    "fields",
    [
        [(b"Idempotency-Key", b"k\xff1"), (b"idempotency-key", b"second")],
        [(b"X-Other", b"v")],
        [],
    ],
)
def test_text_header_reads_as_mitmproxy_does(fields: list[tuple[bytes, bytes]]) -> None:
    first = next((v for k, v in fields if k.lower() == b"idempotency-key"), None)
    expected = None
    if first is not None:
        expected = http.Headers([(b"idempotency-key", first)]).get("idempotency-key")
    assert text_header(fields, b"idempotency-key") == expected


HEADS = [
    (b"POST", 200, b"HTTP/1.1", [(b"Transfer-Encoding", b"chunked")]),
    (b"POST", 200, b"HTTP/1.1", [(b"content-length", b"42")]),
    (b"POST", 200, b"HTTP/1.1", [(b"Content-Length", b"7"), (b"Content-Length", b"7")]),
    (b"POST", 200, b"HTTP/1.1", [(b"transfer-encoding", b"gzip, chunked")]),
    (b"POST", 200, b"HTTP/1.1", [(b"content-length", b"3"), (b"transfer-encoding", b"chunked")]),
    (b"POST", 200, b"HTTP/1.0", []),
    (b"POST", 204, b"HTTP/1.1", [(b"content-length", b"9")]),
    (b"POST", 101, b"HTTP/1.1", []),
    (b"HEAD", 200, b"HTTP/1.1", [(b"content-length", b"9")]),
    (b"head", 200, b"HTTP/1.1", [(b"content-length", b"9")]),
    (b"POST", 200, b"HTTP/1.1", [(b"connection", b"close"), (b"content-length", b"1")]),
    (b"POST", 200, b"HTTP/1.1", [(b"Connection", b"keep-alive")]),
    (b"POST", 200, b"HTTP/1.0", [(b"connection", b"keep-alive")]),
]


@pytest.mark.parametrize(("method", "status", "version", "fields"), HEADS)
def test_the_upstream_framing_reads_are_mitmproxys(
    method: bytes, status: int, version: bytes, fields: list[tuple[bytes, bytes]]
) -> None:
    head = b"%s %d X\r\n" % (version, status) + b"".join(k + b": " + v + b"\r\n" for k, v in fields)
    response = messages.response_head(head + b"\r\n")

    class Method:
        def __init__(self) -> None:
            self.method = method.decode()

    try:
        expected: Any = http1.expected_http_body_size(Method(), response)  # type: ignore[arg-type]
    except ValueError:
        expected = ValueError
    if expected is ValueError:
        with pytest.raises(ValueError):
            _body_size(method, response)
    else:
        assert _body_size(method, response) == expected
    assert _closes(response) == http1.connection_close(version, response.headers)


SPANS = [{"version": "3", "start": 0, "end": 2}]
SPAN_VALUES = st.sampled_from([None, SPANS, [{"version": "4", "start": 0, "end": 1}], "bad"])


def _holding(value: Any) -> dict[str, Any]:
    return {} if value is None else {"weight_versions": value}


@settings(max_examples=200, deadline=None)
@given(SPAN_VALUES, SPAN_VALUES, SPAN_VALUES, st.booleans())
def test_a_stream_event_s_spans_are_the_ones_a_whole_reply_s_reading_takes(
    own, inner, third, null
) -> None:
    """Each dialect looks for spans only where its events carry them, and takes the first
    that carries any, as `reported_spans` reads a whole reply: a malformed first value is
    not passed over for a later one, and a null is no value."""
    top = {"weight_versions": None} if null and own is None else _holding(own)
    events = {
        "chat": {**top, "choices": [{"index": 0, "delta": {"content": "x"}, **_holding(inner)}]},
        "messages": {
            **top,
            "type": "message_delta",
            "message": {"id": "m", **_holding(inner)},
            "delta": {"stop_reason": "end_turn", **_holding(third)},
        },
        "responses": {
            **top,
            "type": "response.in_progress",
            "response": {"id": "r", **_holding(inner)},
        },
    }
    for dialect, event in events.items():
        module = {"chat": chat, "messages": messages_dialect, "responses": responses}[dialect]
        stream = module.DIALECT.assembler()
        name = b"" if dialect == "chat" else b"event: %s\n" % event["type"].encode()
        stream.feed(name + b"data: " + orjson.dumps(event) + b"\n\n")
        assert stream.weight_versions == reported_spans(event), dialect

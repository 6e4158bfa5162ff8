"""Learned event shapes: a stream read with them reads as the same stream parsed event by event.

A stream's token events differ only in their piece, so after reading some the assembler
takes the next ones by their bytes around the piece (skycap.dialects.sse, `learn_shape`),
and passes by unread events on how the last one began. The oracle is the same stream fed
a byte at a time, which takes neither shortcut.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from skycap.dialects import chat, messages, responses
from skycap.dialects.sse import EVENTS_BEFORE_SHAPES, EventStream, StreamError
from skycap.mock.replies import Reply
from skycap.mock.responses import response_object, stream_events

PIECES = st.text(alphabet=st.sampled_from(list('ab "\\/\n\té€😀') + ["\x00", "\u2028"]), max_size=6)
#: How an upstream may encode an event: compact UTF-8, Python's ASCII escapes, spaced.
ENCODINGS = st.sampled_from(
    [
        orjson.dumps,
        lambda v: json.dumps(v).encode(),
        lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode(),
    ]
)


def _read(events: list[bytes], assembler: EventStream, how: str) -> dict[str, Any]:
    """Everything a relay and a record take from the assembler after `events`."""
    if how == "bytes":
        for event in events:
            for i in range(len(event)):
                assembler.feed(event[i : i + 1])
    elif how == "events":
        for event in events:
            assembler.feed(event)
    else:
        assembler.feed(b"".join(events))
    try:
        result: Any = assembler.result()
    except StreamError as exc:
        result = str(exc)
    return {
        "result": result,
        "usage": assembler.usage,  # type: ignore[attr-defined]
        "spans": assembler.weight_versions,
        "done": assembler.done,
        "finish_seen": assembler.finish_seen,  # type: ignore[attr-defined]
        "events": assembler._events,
        "passed": assembler.passed,
    }


def _same_all_ways(events: list[bytes], new: Any) -> dict[str, Any]:
    oracle = _read(events, new(), "bytes")
    assert _read(events, new(), "events") == oracle
    assert _read(events, new(), "chunk") == oracle
    return oracle


def _chat_event(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [choice],
    } | extra


def _sse(payload: bytes, name: str | None = None) -> bytes:
    return (
        (b"" if name is None else b"event: " + name.encode() + b"\n")
        + b"data: "
        + payload
        + b"\n\n"
    )


CHAT_DELTAS = st.one_of(
    PIECES.map(lambda p: {"content": p}),
    PIECES.map(lambda p: {"reasoning_content": p}),
    PIECES.map(lambda p: {"reasoning": p}),
    st.tuples(st.integers(0, 1), PIECES).map(
        lambda t: {"tool_calls": [{"index": t[0], "function": {"arguments": t[1]}}]}
    ),
    st.integers(0, 1).map(
        lambda i: {"tool_calls": [{"index": i, "id": f"call_{i}", "function": {"name": "f"}}]}
    ),
)
CHAT_EXTRAS = st.one_of(
    st.just({}),
    st.just({}),
    st.integers(0, 2).map(lambda n: {"created": n}),
    st.just({"usage": {"completion_tokens": 1}}),
    st.just({"weight_versions": [[0, 1, 7]]}),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(CHAT_DELTAS, CHAT_EXTRAS), max_size=20), ENCODINGS, st.booleans())
def test_a_chat_stream_reads_the_same_with_shapes(deltas, encode, finish) -> None:
    events = [_sse(encode(_chat_event(delta, **extra))) for delta, extra in deltas]
    if finish:
        last = _chat_event({})
        last["choices"][0]["finish_reason"] = "stop"
        events += [_sse(encode(last)), b"data: [DONE]\n\n"]
    events += events[-2:]  # events after [DONE] are not read, by either path
    _same_all_ways(events, chat.DIALECT.assembler)


MESSAGES_DELTAS = st.one_of(
    PIECES.map(lambda p: {"type": "text_delta", "text": p}),
    PIECES.map(lambda p: {"type": "thinking_delta", "thinking": p}),
    PIECES.map(lambda p: {"type": "input_json_delta", "partial_json": p}),
    PIECES.map(lambda p: {"type": "signature_delta", "signature": p}),
)
BLOCKS = st.sampled_from(
    [
        {"type": "text", "text": ""},
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
    ]
)
MESSAGES_EVENTS = st.one_of(
    st.tuples(st.integers(0, 1), MESSAGES_DELTAS).map(
        lambda t: ("content_block_delta", {"index": t[0], "delta": t[1]})
    ),
    st.tuples(st.integers(0, 1), BLOCKS).map(
        lambda t: ("content_block_start", {"index": t[0], "content_block": t[1]})
    ),
    st.just(("ping", {})),
    st.integers(0, 1).map(lambda i: ("content_block_stop", {"index": i})),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(MESSAGES_EVENTS, max_size=20), ENCODINGS)
def test_a_messages_stream_reads_the_same_with_shapes(body, encode) -> None:
    def event(kind: str, fields: dict[str, Any]) -> bytes:
        return _sse(encode({"type": kind, **fields}), kind)

    start = {"message": {"id": "msg_1", "role": "assistant", "usage": {"input_tokens": 3}}}
    events = [event("message_start", start)]
    events += [event(kind, fields) for kind, fields in body]
    events.append(event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {}}))
    events.append(event("message_stop", {}))
    events += events[-3:-2]  # after message_stop: not read
    _same_all_ways(events, messages.DIALECT.assembler)


#: Bytes to put where a learned shape's piece was: a string body or not, or not JSON.
MIDDLES = st.text(alphabet=st.sampled_from(list('ab",:{}[]\\1 u\n')), max_size=12).map(str.encode)


@settings(max_examples=500, deadline=None)
@given(st.lists(MIDDLES, min_size=1, max_size=4))
def test_only_a_whole_json_string_takes_the_shape(middles) -> None:
    """Whatever is spliced in where the piece was, the stream reads as parsed in full:
    a middle that closes the string and adds keys, or breaks the JSON, is not a piece."""
    head = b'data: {"choices":[{"index":0,"delta":{"content":"'
    tail = b'"},"finish_reason":null}]}\n\n'
    events = [head + b"first" + tail] * (EVENTS_BEFORE_SHAPES + 1) + [
        head + m + tail for m in middles
    ]
    events.append(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
    _same_all_ways(events, chat.DIALECT.assembler)


def test_a_shape_is_taken_once_learned() -> None:
    """The claim the benchmark rests on: token events after the first are not parsed whole."""
    head, tail = b'data: {"choices":[{"index":0,"delta":{"content":"', b'"}}]}\n\n'

    class Counted(chat.StreamAssembler):
        parsed = 0

        def _event(self, name: bytes | None, event: dict[str, Any]) -> None:
            self.parsed += 1
            super()._event(name, event)

    assembler = Counted()
    pieces = [b"a"] * (EVENTS_BEFORE_SHAPES + 1) + [b"b", b"\\u00e9", b'\\"']
    for piece in pieces:
        assembler.feed(head + piece + tail)
    assert assembler.parsed == EVENTS_BEFORE_SHAPES + 1 and assembler._events == len(pieces)
    assert "".join(assembler._choices[0].content) == "a" * (EVENTS_BEFORE_SHAPES + 1) + 'b\u00e9"'


def test_a_block_started_again_takes_its_pieces() -> None:
    """A shape learned for a block does not outlive it: a block started again at the same
    index takes the pieces that follow, though their bytes match the shape."""

    def event(kind: str, **fields: Any) -> bytes:
        return _sse(orjson.dumps({"type": kind, **fields}), kind)

    delta = event("content_block_delta", index=0, delta={"type": "text_delta", "text": "x"})
    start = event("content_block_start", index=0, content_block={"type": "text", "text": ""})
    stream = [event("message_start", message={}), start, *[delta] * EVENTS_BEFORE_SHAPES, start]
    stream += [delta]
    stream += [event("message_delta", delta={"stop_reason": "end_turn"})]
    assembler = messages.DIALECT.assembler()
    for chunk in stream:
        assembler.feed(chunk)
    reply, _ = assembler.result()
    assert reply["content"] == "x"


def test_a_piece_repeated_later_in_the_event_is_not_taken_for_it() -> None:
    """The shape is tried with a probe in place: a later field with the piece's value (the
    last match in the bytes) does not pass for the piece."""

    def event(content: str, after: str) -> bytes:
        choice = {"index": 0, "delta": {"content": content}, "finish_reason": None, "x": after}
        return _sse(orjson.dumps({"choices": [choice]}))

    stop = _sse(b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}')
    events = [event("a", "a")] * (EVENTS_BEFORE_SHAPES + 1) + [event("a", "zz"), stop]
    oracle = _same_all_ways(events, chat.DIALECT.assembler)
    assert oracle["result"][0]["content"] == "a" * (EVENTS_BEFORE_SHAPES + 2)


#: Blocks that begin as a passed-by delta does but are not one `data:` line of an object.
ODD_DELTAS = st.sampled_from(
    [
        b'event: response.output_text.delta\ndata: {"a":1}\ndata: 2\n\n',
        b'event: response.output_text.delta\ndata: {"a":1}\nid: 7\n\n',
        b"event: response.output_text.delta\ndata: [DONE]\n\n",
        b"event: response.output_text.delta\ndata: {not json\n\n",
        b"event: response.output_text.delta \ndata: {}\n\n",
        b"event: response.output_text.deltas\ndata: {}\n\n",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    PIECES,
    st.lists(st.tuples(st.integers(0, 40), ODD_DELTAS), max_size=3),
    st.booleans(),
)
def test_a_responses_stream_passes_by_the_same_events(text, odd, whole) -> None:
    """Deltas are passed by on how the last one began; any block that only begins so is
    read by the full rules, and what is kept of the last one passed by is the same (the
    stream cut anywhere: a failure event numbers after it)."""
    response = response_object(
        Reply(content=text * 5), {}, response_id="r1", number=0, request_size=9
    )
    events = stream_events(response)
    deltas = [i for i, event in enumerate(events) if b"output_text.delta" in event]
    for at, block in sorted(odd, reverse=True):  # after a delta, or anywhere
        events.insert(deltas[at] + 1 if at < len(deltas) else min(at, len(events)), block)
    # Cut after the last odd block, or not at all.
    odd_at = [i for i, event in enumerate(events) if event in {block for _, block in odd}]
    cut = len(events) if whole or not odd_at else odd_at[-1] + 1
    _same_all_ways(events[:cut], responses.DIALECT.assembler)


#: Blocks that are not an optional `event:` line and one `data:` line, as the framing's one
#: scan of a chunk's events reads them, each a way to differ from that by a little.
ODD_BLOCKS = st.sampled_from(
    [
        b"\n\n",  # a blank line more
        b": keep-alive\n\n",
        b"event: \ndata: {}\n\n",  # an empty name
        b'event:  message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"x"}}\n\n',
        b'event: message_delta \ndata: {"type":"message_delta","delta":{"stop_reason":"y"}}\n\n',
        b'event:message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"z"}}\n\n',
        b'data:{"type":"ping"}\n\n',
        b'id: 4\ndata: {"type":"ping"}\n\n',
        b'data: {"type":"error","error":{"type":"a"}}\ndata: {"b":1}\n\n',
        b"event: ping\n\n",
        b"data: [DONE]\n\n",
        b"data: {not json\n\n",
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"odd"}}\nid: 1\n\n',
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(MESSAGES_EVENTS, max_size=12),
    st.lists(st.tuples(st.integers(0, 20), ODD_BLOCKS), max_size=3),
    st.integers(1, 4),
)
def test_a_stream_with_odd_blocks_reads_the_same_in_chunks_of_events(body, odd, per_chunk) -> None:
    """Chunks of several whole events are read by one scan when every event in them is
    simple; an odd block anywhere among them, whatever it is, reads as the line rules read it."""

    def event(kind: str, fields: dict[str, Any]) -> bytes:
        return _sse(orjson.dumps({"type": kind, **fields}), kind)

    start = {"message": {"id": "msg_1", "role": "assistant", "usage": {"input_tokens": 3}}}
    events = [event("message_start", start)]
    events += [event(kind, fields) for kind, fields in body]
    events.append(event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {}}))
    events.append(event("message_stop", {}))
    for at, block in sorted(odd, reverse=True):
        events.insert(min(at, len(events)), block)
    chunks = [b"".join(events[i : i + per_chunk]) for i in range(0, len(events), per_chunk)]
    _same_all_ways(chunks, messages.DIALECT.assembler)
    for new in (chat.DIALECT.assembler, responses.DIALECT.assembler):
        _same_all_ways(chunks, new)  # read as no stream of theirs: the same error each way

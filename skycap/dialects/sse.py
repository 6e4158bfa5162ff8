"""The SSE framing every dialect's upstream stream shares: lines in, one event at a time out."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

import orjson

from skycap.weights import Span, well_formed_spans

_PAYLOAD_PREVIEW = 200
#: A string no upstream can know, put where a shape's string was to test the shape.
_PROBE = "skycap" + secrets.token_hex(8)
#: Shapes learned per stream at most: enough for a reply's content, reasoning and a dozen
#: tool calls, and a bound on the work wasted on events that differ in more than a string.
SHAPES_PER_STREAM = 16
#: A stream's first events are read in full, no shape tried: learning one costs about two
#: events, so a short reply is read without.
EVENTS_BEFORE_SHAPES = 8

#: Keys and indexes from an event's top to one of its values.
type Where = tuple[str | int, ...]
#: An event's bytes before and after one JSON string, what takes the string, and where
#: the string's quotes are: (head, tail, apply, head's last byte, tail's first from the end).
type Shape = tuple[bytes, bytes, Callable[[str], None], int, int]
#: One event of a chunk of such events: an optional `event: <name>` line and one `data: `
#: line, starting the chunk or after a blank line; found as (name or b"", payload).
_SIMPLE_EVENT = re.compile(rb"(?:^|(?<=\n\n))(?:event: (\S+)\n)?data: ([^\n]*)\n\n")


class StreamError(ValueError):
    """The stream cannot be recorded; the message starts `unreadable stream: ` (format.md §4)."""


class EventStream:
    """Split raw response bytes, arriving in chunks split anywhere, into SSE events.

    Work per `feed` is proportional to the chunk (only an unterminated line is carried
    over), so a subclass can sit in the relay's hot path. `feed` never raises: a relay must
    keep passing bytes to the harness, so a bad payload is remembered in `_error` and
    raised by the subclass's `result()`. Each complete event's JSON object goes to
    `_event(name, event)`; `data: [DONE]` sets `done`. An event the server never
    terminated with a blank line is dropped, as the SSE rules (and the SDKs) do.
    `weight_versions` keeps the last well-formed spans an event carried (skycap.weights).

    A subclass that reads only some events by their `event:` name lists them in `READS`
    (None: every event is read). An event named otherwise (a Responses stream's per-token
    deltas, which its terminal event repeats) is passed by unparsed, which on a long
    stream is most of the work; only the last one's payload is kept (`passed`). An event
    without a name is read.

    A stream's first `EVENTS_BEFORE_SHAPES` events are found in their chunk by one scan
    when every event in it is one `data: ` line after an optional `event: ` line (a reply's
    opening events often arrive together); a chunk holding anything else is read block by
    block, and past those events the shapes and pass-bys below take over.

    A stream's token events mostly differ in one string, the piece. A subclass that reads
    an event whose only effect is to take one string (`apply(text)`) says so with
    `learn_shape` (past the stream's first `EVENTS_BEFORE_SHAPES` events: a subclass asks
    before looking for the piece), and the events that are the same bytes but for that
    string go to `apply` with only the string parsed, until any other event is read.
    """

    READS: frozenset[bytes] | None = None

    __slots__ = (
        "_pending",
        "_held_cr",
        "_data",
        "_name",
        "_done",
        "_error",
        "_events",
        "passed",
        "weight_versions",
        "_shape",
        "_shapes_left",
        "_block",
        "_unread",
    )

    def __init__(self) -> None:
        self._pending: list[bytes] = []
        self._held_cr = False
        self._data: list[bytes] = []
        self._name: bytes | None = None
        self._done = False
        self._error: str | None = None
        self._events = 0
        self.passed: bytes | None = None
        self.weight_versions: list[Span] | None = None
        self._shape: Shape | None = None
        self._shapes_left = SHAPES_PER_STREAM
        # The event `_whole_events` read last (it may teach a shape): its bytes, or its
        # (name or b"", payload) when found by the one scan; or None.
        self._block: bytes | tuple[bytes, bytes] | None = None
        # How the last event passed by unread began, up to its payload's `{`: the next
        # events that begin so (one `data:` line) are passed by on that alone.
        self._unread: bytes | None = None

    @property
    def done(self) -> bool:
        """Whether the stream's end marker was seen; later events are ignored."""
        return self._done

    def cut(self) -> bytes:
        """What ends an event the upstream left unfinished (a blank line), or nothing: sent
        before a failure event, so the harness's parser reads that event on its own."""
        return b"\n\n" if self._pending or self._data or self._held_cr else b""

    def feed(self, chunk: bytes) -> None:
        """Consume one chunk of the response body, split anywhere."""
        if (
            chunk[-2:] == b"\n\n"
            and not (self._pending or self._data or self._held_cr)
            and chunk.find(b"\r") < 0
        ):
            self._whole_events(chunk)
            return
        if self._held_cr:
            chunk = b"\r" + chunk
            self._held_cr = False
        if chunk.endswith(b"\r"):
            # It may be the first half of a CRLF split across chunks: decide on the next feed.
            chunk = chunk[:-1]
            self._held_cr = True
        if chunk[-1:] == b"\n":  # whole events: no need to look for the last newline
            cut = len(chunk) - 1
        else:
            cut = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if cut < 0:
            if chunk:
                self._pending.append(chunk)
            return
        lines = chunk[: cut + 1]
        if self._pending:
            self._pending.append(lines)
            lines = b"".join(self._pending)
            self._pending = []
        if cut + 1 < len(chunk):
            self._pending.append(chunk[cut + 1 :])
        self._lines(lines)

    def _whole_events(self, chunk: bytes) -> None:
        """A chunk of whole events, the usual chunk: an event that is one `data: ` line,
        after an `event: ` line or not, is read without the line-by-line rules."""
        reads = self.READS
        if self._events < EVENTS_BEFORE_SHAPES:
            # A stream's first events, often several to a chunk, found by one scan (later
            # ones are the shapes and pass-bys below, cheaper one to a chunk). Each match
            # ends at one of the chunk's blank lines: any other text leaves one over.
            events = _SIMPLE_EVENT.findall(chunk)
            if len(events) == chunk.count(b"\n\n"):
                for event in events:
                    name, payload = event
                    self._block = event
                    if payload[:1] != b"{" or self._done or self._error is not None:
                        self._payload(payload, name or None)  # the end marker, or not read
                    elif not name or reads is None or name in reads:
                        self._read(payload, name or None)  # as `_payload` would
                    else:
                        self._events += 1  # passed by, as `_payload` would
                        self.passed = payload
                return
        shape, unread = self._shape, self._unread
        for block in chunk[:-2].split(b"\n\n"):
            if shape is not None and block.startswith(shape[0]) and block.endswith(shape[1]):
                # From head's closing quote to tail's opening one: one JSON string, or (a
                # block too short to hold both, a body with a quote in it) an error.
                try:
                    text = orjson.loads(block[shape[3] : len(block) + shape[4]])
                except orjson.JSONDecodeError:
                    pass
                else:
                    self._events += 1
                    shape[2](text)
                    continue
            if (
                unread is not None
                and block.startswith(unread)
                and block.find(b"\n", len(unread)) < 0
                and not self._done
                and self._error is None
            ):
                self._events += 1  # the event passed by last time, named the same
                self.passed = block[len(unread) - 1 :]
                continue
            data, name = block, None
            if data.startswith(b"event: "):
                end = data.find(b"\n")
                if end > 0:
                    name = data[7:end].strip()
                    data = data[end + 1 :]
            if data.startswith(b"data: ") and data.find(b"\n") < 0:
                payload = data[6:]
                self._block = block
                if payload[:1] != b"{" or self._done or self._error is not None:
                    self._payload(payload, name)  # the end marker, or not read at all
                elif name is None or reads is None or name in reads:
                    self._read(payload, name)  # as `_payload` would, its checks made here
                else:
                    self._events += 1  # passed by, as `_payload` would
                    self.passed = payload
                    unread = self._unread = block[: end + 8]  # `event: <name>\ndata: {`
                    continue
                shape = self._shape
            else:
                self._lines(block + b"\n\n")
                shape = self._shape

    def _lines(self, lines: bytes) -> None:
        """Whole lines, by the field rules (inline: one method call per event, not per
        line; a stream's events are most of what a streamed call costs to capture)."""
        self._block = None  # no shapes learned from events read by these rules
        data = self._data
        for line in lines.splitlines():
            if not line:
                if data:
                    self._dispatch()
                    data = self._data
                else:
                    self._name = None
            elif line.startswith(b"data:"):
                data.append(line[6:] if line.startswith(b"data: ") else line[5:])
            elif line == b"data":
                data.append(b"")
            elif line.startswith(b"event:"):
                self._name = line[6:].strip()

    def _dispatch(self) -> None:
        data, name = self._data, self._name
        self._data, self._name = [], None
        self._payload(data[0] if len(data) == 1 else b"\n".join(data), name)

    def _payload(self, payload: bytes, name: bytes | None) -> None:
        if self._done or self._error is not None:
            return  # events after the end, or after an unreadable one, are not read
        if payload.strip() == b"[DONE]":
            self._done = True
            self._shape = None
            return
        if name is not None and self.READS is not None and name not in self.READS:
            self._events += 1
            self.passed = payload
            return
        self._read(payload, name)

    def _read(self, payload: bytes, name: bytes | None) -> None:
        """Parse one event `_payload` lets through and hand it to `_event`."""
        self._shape = None  # a shape holds only until another event is read
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            self._error = (
                f"unreadable stream: a data payload is not JSON ({exc}): "
                f"{payload[:_PAYLOAD_PREVIEW]!r}"
            )
            return
        if type(event) is not dict:
            self._error = (
                f"unreadable stream: a data payload is not a JSON object: "
                f"{payload[:_PAYLOAD_PREVIEW]!r}"
            )
            return
        self._events += 1
        self._event(name, event)

    def learn_shape(
        self,
        event: dict[str, Any],
        where: Where,
        text: str,
        apply: Callable[[str], None],
    ) -> None:
        """`event`, just read, did nothing but `apply(text)`, `text` being the string at
        the path `where` in it: events that are its bytes but for that string go to `apply`.

        The shape is the event's bytes around the string as the upstream encoded it, and it
        is kept only if the event with a probe string in that place parses to the event
        with the probe at `where`: the string is then exactly that value, and any event of
        those bytes around one valid JSON string body is this event with another string.
        """
        block = self._block
        if block is None or not self._shapes_left:
            return
        self._shapes_left -= 1
        if type(block) is tuple:  # the bytes the scan found it as
            name, payload = block
            block = (b"event: " + name + b"\n" if name else b"") + b"data: " + payload
        start = 6 if block.startswith(b"data: ") else block.find(b"\n") + 7
        encoded = orjson.dumps(text)
        at = block.rfind(encoded)
        if at < start:
            return
        head, tail = block[: at + 1], block[at + len(encoded) - 1 :]
        try:
            probe = orjson.loads(head[start:] + _PROBE.encode() + tail)
        except orjson.JSONDecodeError:
            return
        if probe == _replaced(event, where, _PROBE):
            self._shape = (head, tail, apply, len(head) - 1, 1 - len(tail))

    def _event(self, name: bytes | None, event: dict[str, Any]) -> None:
        """One event's JSON object; a subclass calls `note_spans` on the first of the
        objects its dialect's events carry `weight_versions` on that has them."""
        raise NotImplementedError

    def note_spans(self, holder: dict[str, Any]) -> None:
        """Keep the spans `holder` carries, if well-formed (a later event's replace these)."""
        value = holder.get("weight_versions")
        if value is not None and (spans := well_formed_spans(value)) is not None:
            self.weight_versions = spans


def _replaced(value: Any, where: Where, new: str) -> Any:
    """`value` with the value at path `where` replaced by `new` (copies along the path)."""
    if not where:
        return new
    copy = list(value) if type(value) is list else dict(value)
    copy[where[0]] = _replaced(value[where[0]], where[1:], new)  # type: ignore[index]
    return copy


def frame(payload: Any, event: str | None = None) -> bytes:
    """One SSE event: an optional `event:` line, then its JSON `data:` line."""
    data = b"data: " + orjson.dumps(payload) + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data

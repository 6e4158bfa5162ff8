"""Text mode's reading of an upstream Responses reply, streamed (SSE events) or JSON.

The recorded reply is the terminal event's response (`response.completed` or
`response.incomplete`): its `output` items, read as `read_items` reads a replayed
history, so the reply and its later replay are the same canonical message. Items seen in
`response.output_item.done` events stand in when a server sends a terminal response
without its output. A `response.failed` or `error` event, or a stream that ends before a
terminal event, cannot be recorded as a reply.
"""

from __future__ import annotations

from typing import Any

import orjson

from skycap.dialects.opaque import OPAQUE_ROLE
from skycap.dialects.responses_read import read_items
from skycap.dialects.sse import EventStream, StreamError
from skycap.wire import BodyError

_PREVIEW = 200
TERMINAL = ("response.completed", "response.incomplete")
#: The events that announce the response before its output.
ANNOUNCED = ("response.created", "response.queued", "response.in_progress")
ITEM_DONE = "response.output_item.done"
FAILED = ("response.failed", "error")
_ITEM_DONE = ITEM_DONE.encode()
_KEPT = frozenset((*(name.encode() for name in ANNOUNCED), _ITEM_DONE))


def read_response(response: Any) -> tuple[dict[str, Any], str, dict[str, Any] | None]:
    """(message, finish reason, usage) of a response object; ValueError naming what is wrong."""
    if not isinstance(response, dict) or not isinstance(response.get("output"), list):
        raise ValueError(f"no `output` list in the response: {response!r:.{_PREVIEW}}")
    try:
        messages = read_items(response["output"], where="output")
    except BodyError as exc:
        raise ValueError(f"the response's output cannot be read: {exc}") from None
    # An item that would stand alone in a request (a remote compaction's `compaction`
    # item) is the model's own in a reply.
    messages = [
        {"role": "assistant", "content": m["content"]} if m.get("role") == OPAQUE_ROLE else m
        for m in messages
    ]
    if len(messages) > 1 or any(m.get("role") != "assistant" for m in messages):
        raise ValueError("the response's output is not one assistant turn")
    message = messages[0] if messages else {"role": "assistant", "content": None}
    usage = response.get("usage")
    return message, finish_reason(response, message), usage if isinstance(usage, dict) else None


def finish_reason(response: dict[str, Any], message: dict[str, Any]) -> str:
    """The canonical (chat) finish reason the call records for a response's status."""
    if response.get("status") == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return "length" if reason in (None, "max_output_tokens") else str(reason)
    return "tool_calls" if message.get("tool_calls") else "stop"


class ResponsesAssembler(EventStream):
    """Feed the raw SSE bytes as they arrive; ask for the recorded reply at the end.

    `finish_seen` and `done` turn on together, at the first terminal or failure event (a
    Responses stream has no `[DONE]`: its terminal event is its last), so the relay holds
    back the chunk carrying it, commits, then releases it. `reply_id` is the response's id.

    Only the events below are read; the rest (deltas, parts) are passed by unparsed
    (`EventStream`): the terminal event carries the whole output. The response announced
    at the start (created, queued, in progress) and each output item's `done` event are
    kept unparsed unless their bytes hold `weight_versions`, and parsed only when the
    terminal event leaves them needed: its output missing (the items stand in), its id
    missing, or no terminal event at all (the failure event sent then repeats the
    announced response). Like a delta, a kept event is not checked unless it is needed.
    """

    READS = frozenset(name.encode() for name in (*ANNOUNCED, ITEM_DONE, *TERMINAL, *FAILED))

    __slots__ = ("_announced", "_done_items", "_terminal", "_failure", "_sequence")

    def __init__(self) -> None:
        super().__init__()
        # Announced responses and done items, each in arrival order: a payload kept
        # unparsed, or the event when it was parsed (it carried spans, or the stream names
        # no events).
        self._announced: list[bytes | dict[str, Any]] = []
        self._done_items: list[bytes | dict[str, Any]] = []
        self._terminal: dict[str, Any] | None = None
        self._failure: Any = None
        self._sequence = -1  # the last sequence_number of an event read

    @property
    def finish_seen(self) -> bool:
        return self._done

    @property
    def reply_id(self) -> str | None:
        """The terminal response's id, else the last one announced."""
        if self._terminal is not None and isinstance(self._terminal.get("id"), str):
            return self._terminal["id"]
        response = self.response
        return response["id"] if response is not None else None

    @property
    def response(self) -> dict[str, Any] | None:
        """The last response object the stream announced (one with a string id)."""
        for event in reversed(_events(self._announced)):
            response = event.get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                return response
        return None

    @property
    def sequence(self) -> int:
        """The last sequence_number seen, an event passed by unread included (-1: none)."""
        numbers = [self._sequence]
        kept = [*self._announced, *self._done_items]
        if self.passed is not None:
            kept.append(self.passed)
        for event in _events(kept):
            if type(number := event.get("sequence_number")) is int:
                numbers.append(number)
        return max(numbers)

    @property
    def usage(self) -> dict[str, Any] | None:
        usage = self._terminal.get("usage") if self._terminal is not None else None
        return usage if isinstance(usage, dict) else None

    def _read(self, payload: bytes, name: bytes | None) -> None:
        if name in _KEPT and payload.find(b"weight_versions") < 0:
            self._events += 1
            (self._done_items if name == _ITEM_DONE else self._announced).append(payload)
        else:
            EventStream._read(self, payload, name)

    def _event(self, name: bytes | None, event: dict[str, Any]) -> None:
        kind = event.get("type")
        response = event.get("response")
        if type(sequence := event.get("sequence_number")) is int:
            self._sequence = max(self._sequence, sequence)
        # The event's own spans, else its response's, as skycap.weights.reported_spans reads.
        if event.get("weight_versions") is not None:
            self.note_spans(event)
        elif isinstance(response, dict) and response.get("weight_versions") is not None:
            self.note_spans(response)
        if kind in TERMINAL and isinstance(response, dict):
            self._terminal = response
            self._done = True
        elif kind in FAILED:
            failed = response if isinstance(response, dict) else event
            self._failure = failed.get("error") or event
            self._done = True
        elif kind in ANNOUNCED:
            self._announced.append(event)
        elif kind == ITEM_DONE:
            self._done_items.append(event)

    def _items(self) -> list[Any]:
        """The output items of the `done` events, by output index."""
        items: dict[int, Any] = {}
        for kept in self._done_items:
            event = _parsed(kept) if type(kept) is bytes else kept
            if event is None:
                raise StreamError(
                    f"unreadable stream: the terminal response has no output and a "
                    f"{ITEM_DONE} payload, which would stand in for it, is not a JSON "
                    f"object: {kept[:_PREVIEW]!r}"
                )
            index, item = event.get("output_index"), event.get("item")
            if type(index) is int and isinstance(item, dict):
                items[index] = item
        return [items[i] for i in sorted(items)]

    def result(self) -> tuple[dict[str, Any], str]:
        """(message, finish reason) of the terminal response (StreamError if there is none)."""
        if self._error is not None:
            raise StreamError(self._error)
        if self._failure is not None:
            raise StreamError(f"unreadable stream: the upstream reported {self._failure!r:.300}")
        if self._terminal is None:
            raise StreamError(
                f"unreadable stream: no response.completed in {self._events} JSON events"
            )
        response = self._terminal
        if not response.get("output") and self._done_items and (items := self._items()):
            response = {**response, "output": items}
        try:
            message, reason, _ = read_response(response)
        except ValueError as exc:
            raise StreamError(f"unreadable stream: {exc}") from None
        return message, reason


def _events(kept: list[bytes | dict[str, Any]]) -> list[dict[str, Any]]:
    """The kept events that are JSON objects, parsed, in order."""
    events = (_parsed(event) if type(event) is bytes else event for event in kept)
    return [event for event in events if event is not None]


def _parsed(payload: bytes) -> dict[str, Any] | None:
    """An event's payload as its JSON object, or None when it is not one."""
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return event if type(event) is dict else None

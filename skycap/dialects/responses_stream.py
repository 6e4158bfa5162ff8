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

from skycap.dialects.responses_read import RequestError, read_items

_PREVIEW = 200
TERMINAL = ("response.completed", "response.incomplete")
FAILED = ("response.failed", "error")


class ReplyError(ValueError):
    """The reply cannot be recorded; the message starts `unreadable stream: ` when streamed."""


def read_response(response: Any) -> tuple[dict[str, Any], str, dict[str, Any] | None, str | None]:
    """(message, finish reason, usage, response id) of a response object (ReplyError if bad)."""
    if not isinstance(response, dict):
        raise ReplyError(f"the reply is not a response object: {response!r:.{_PREVIEW}}")
    output = response.get("output")
    if not isinstance(output, list):
        raise ReplyError("the response has no `output` list")
    try:
        messages = read_items(output)
    except RequestError as exc:
        raise ReplyError(f"the response's output cannot be read: {exc}") from None
    if len(messages) > 1 or any(m.get("role") != "assistant" for m in messages):
        raise ReplyError("the response's output is not one assistant turn")
    message = messages[0] if messages else {"role": "assistant", "content": None}
    usage = response.get("usage")
    response_id = response.get("id")
    return (
        message,
        finish_reason(response, message),
        usage if isinstance(usage, dict) else None,
        response_id if isinstance(response_id, str) else None,
    )


def finish_reason(response: dict[str, Any], message: dict[str, Any]) -> str:
    """The chat-side finish reason the call records for a response's status."""
    if response.get("status") == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return "length" if reason in (None, "max_output_tokens") else str(reason)
    return "tool_calls" if message.get("tool_calls") else "stop"


class ResponsesAssembler:
    """Feed the raw SSE bytes as they arrive; ask for the recorded reply at the end.

    Like the chat assembler, `feed` never raises and costs time in proportion to the
    chunk; `finish_seen` turns on with the first terminal or failure event, so a relay
    can hold back the chunk carrying it until the reply is committed.
    """

    def __init__(self) -> None:
        self._pending = b""
        self._data: list[bytes] = []
        self._items: dict[int, dict[str, Any]] = {}
        self._terminal: dict[str, Any] | None = None
        self._failure: Any = None
        self._error: str | None = None
        self._events = 0
        self.response_id: str | None = None
        self.sequence_number = -1

    @property
    def finish_seen(self) -> bool:
        return self._terminal is not None or self._failure is not None

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._pending = data
            return
        self._pending = data[cut + 1 :]
        for line in data[: cut + 1].split(b"\n"):
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            elif not line and self._data:
                payload, self._data = b"\n".join(self._data), []
                self._dispatch(payload)

    def _dispatch(self, payload: bytes) -> None:
        if self._error is not None or self.finish_seen:
            return
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            self._error = f"a data payload is not JSON ({exc}): {payload[:_PREVIEW]!r}"
            return
        if not isinstance(event, dict):
            self._error = f"a data payload is not a JSON object: {payload[:_PREVIEW]!r}"
            return
        self._events += 1
        number = event.get("sequence_number")
        if type(number) is int:
            self.sequence_number = number
        kind = event.get("type")
        response = event.get("response")
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            self.response_id = response["id"]
        if kind == "response.output_item.done":
            index, item = event.get("output_index"), event.get("item")
            if type(index) is int and isinstance(item, dict):
                self._items[index] = item
        elif kind in TERMINAL and isinstance(response, dict):
            self._terminal = response
        elif kind in FAILED:
            self._failure = event.get("response", event).get("error") or event

    def result(self) -> tuple[dict[str, Any], str, dict[str, Any] | None]:
        """(message, finish reason, usage) of the terminal response (ReplyError if none)."""
        if self._error is not None:
            raise ReplyError(f"unreadable stream: {self._error}")
        if self._failure is not None:
            raise ReplyError(f"unreadable stream: the upstream reported {self._failure!r:.300}")
        if self._terminal is None:
            raise ReplyError(
                f"unreadable stream: no response.completed in {self._events} JSON events"
            )
        response = self._terminal
        if not response.get("output") and self._items:
            response = {**response, "output": [self._items[i] for i in sorted(self._items)]}
        try:
            message, reason, usage, _ = read_response(response)
        except ReplyError as exc:
            raise ReplyError(f"unreadable stream: {exc}") from None
        return message, reason, usage

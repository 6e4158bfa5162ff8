"""The Responses API's WebSocket mode as messages: what a client sends and what it is sent.

Over a WebSocket (`wss://…/v1/responses`, Codex's default transport) a client sends one
`response.create` message per call, the body of a `POST /v1/responses` plus its `type`,
and is sent the same events a streamed reply carries, each as one message. The API keeps
the newest response of each connection, so a client may continue it with
`previous_response_id` and only the new input items (Codex does, after every turn), and
may send `generate: false` to warm that state up without sampling. skycap keeps the same
connection-local state (`Continuation`), so every call it runs or forwards carries the
whole input, as over HTTPS: the upstream need not keep responses (vLLM keeps none for
`store: false`), and the graph sees the same history either way.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from skycap.dialects.responses import responses_error
from skycap.dialects.responses_reply import new_id
from skycap.dialects.sse import EventStream
from skycap.wire import BodyError

#: The one client message type that is a call.
CREATE = "response.create"
#: Events after which a response is over, and those whose response may be continued.
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
_CONTINUABLE = frozenset({"response.completed", "response.incomplete"})
_ZERO_USAGE = {
    "input_tokens": 0,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 0,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 0,
}


def read_message(content: bytes) -> dict[str, Any] | None:
    """The body of a `response.create` message (its `type` removed); None for another
    message type, which is no call. Raises BodyError (a 400 error event) when the message
    is not a JSON object."""
    try:
        message = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise BodyError(f"a WebSocket message is not JSON ({exc}); send JSON objects") from None
    if not isinstance(message, dict):
        raise BodyError(
            f"a WebSocket message must be a JSON object with a `type`, got {type(message).__name__}"
        )
    if message.get("type") != CREATE:
        return None
    return {key: value for key, value in message.items() if key != "type"}


def error_message(status: int, body: bytes) -> bytes:
    """An HTTP error answer as the API's WebSocket `error` event: its status beside the
    error object, which is how Codex tells a retryable failure from a final one."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict):
        text = body[:2000].decode("utf-8", "replace")
        error = orjson.loads(responses_error(status, text or f"HTTP {status}"))["error"]
    return orjson.dumps({"type": "error", "status": status, "error": error})


def body_error(status: int, message: str, code: str | None = None) -> bytes:
    """skycap's own refusal of a message, as an `error` event."""
    return error_message(status, responses_error(status, message, code))


def _as_items(value: Any) -> list[Any]:
    """A request's `input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


class Continuation:
    """The newest response of one connection: its id and the whole input it continues
    from (the request's input, then the response's output items)."""

    __slots__ = ("response_id", "items")

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.items: list[Any] = []

    def expand(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` with the whole input when its `previous_response_id` names the newest
        response of this connection (the id then goes: what it named is in the input).
        An id this connection did not answer is left for whoever runs the call to find."""
        previous = body.get("previous_response_id")
        if previous is None or previous != self.response_id:
            return body
        expanded = {key: value for key, value in body.items() if key != "previous_response_id"}
        expanded["input"] = [*self.items, *_as_items(body.get("input"))]
        return expanded

    def remember(self, response_id: Any, request_input: Any, output: list[Any]) -> None:
        self.response_id = response_id if isinstance(response_id, str) else None
        self.items = [*_as_items(request_input), *output] if self.response_id else []

    def forget(self) -> None:
        """A failed response cannot be continued (the API evicts it too)."""
        self.response_id, self.items = None, []


def prewarm(body: dict[str, Any]) -> tuple[str, list[bytes]]:
    """(response id, messages) answering `generate: false`: a response with no output,
    which samples nothing and is no call; its input is what a later call continues."""
    response = {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": body.get("model"),
        "output": [],
        "usage": None,
    }
    created = {"type": "response.created", "sequence_number": 0, "response": response}
    done = {**response, "status": "completed", "usage": _ZERO_USAGE}
    completed = {"type": "response.completed", "sequence_number": 1, "response": done}
    return response["id"], [orjson.dumps(created), orjson.dumps(completed)]


class SocketEvents(EventStream):
    """A reply's SSE, fed in chunks split anywhere, as the WebSocket messages it becomes.

    Each event's JSON is one message (its `type` taken from the `event:` line when the data
    lacks one; keep-alives are events too). It notes the response a terminal event ends
    with, so the connection can continue it: `ended` (the terminal event seen), `response`
    (a completed or incomplete response) and `items` (the output items streamed).
    """

    __slots__ = ("messages", "ended", "response", "items")

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[bytes] = []
        self.ended = False
        self.response: dict[str, Any] | None = None
        self.items: list[Any] = []

    def take(self) -> list[bytes]:
        """The messages ready since the last call."""
        messages, self.messages = self.messages, []
        return messages

    def _event(self, name: bytes | None, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind is None and name:
            kind = event["type"] = name.decode("utf-8", "replace")
        if kind == "response.output_item.done":
            self.items.append(event.get("item"))
        elif kind in _TERMINAL:
            self.ended = True
            response = event.get("response")
            if kind in _CONTINUABLE and isinstance(response, dict):
                self.response = response
        self.messages.append(orjson.dumps(event))

    def output(self) -> list[Any]:
        """The ended response's output items (those streamed when it lists none)."""
        listed = self.response.get("output") if self.response is not None else None
        return listed if isinstance(listed, list) and listed else self.items

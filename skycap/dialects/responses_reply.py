"""Token-mode Responses answers written from plain data: the response object and its SSE.

The writer takes the canonical assistant message skycap stored, the finish reason and
usage, and the ids it issues (response and item ids, the reasoning item's opaque
`encrypted_content`), and lays them out as Responses output items: one `reasoning` item,
one `message` item with one `output_text` part, then a `function_call` item per tool call
with the call's id as `call_id`. `skycap.dialects.responses.read_items` reads those items
back to the same message, which keeps a replayed history on one path.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from skycap.dialects.responses_read import ResponsesRequest

#: The response fields echoed from the request, with the values the API reports when unset.
ECHOED = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": None,
    "temperature": None,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "top_p": None,
    "truncation": "disabled",
    "user": None,
}


def new_id(prefix: str) -> str:
    """A fresh id in the API's style (`resp_…`, `msg_…`, `rs_…`, `fc_…`)."""
    return f"{prefix}_{secrets.token_hex(16)}"


def output_items(message: dict[str, Any], response_id: str) -> list[dict[str, Any]]:
    """The output items of an assistant message: reasoning, the message, function calls.

    The reasoning item is the one token mode issued (`reasoning_items`: its id and opaque
    `encrypted_content`); other item ids derive from `response_id`, so the same reply
    always has the same items.
    """
    suffix = response_id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        issued = (message.get("reasoning_items") or [{}])[0]
        item: dict[str, Any] = {"id": issued.get("id") or f"rs_{suffix}", "type": "reasoning"}
        item["summary"] = []
        item["content"] = [{"type": "reasoning_text", "text": reasoning}]
        if issued.get("encrypted_content"):
            item["encrypted_content"] = issued["encrypted_content"]
        items.append(item)
    content = message.get("content")
    texts = content if isinstance(content, list) else [content] if content else []
    if texts:
        parts = [
            {"type": "output_text", "text": t if isinstance(t, str) else t.get("text", "")}
            | {"annotations": [], "logprobs": []}
            for t in texts
        ]
        items.append(
            {
                "id": f"msg_{suffix}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": parts,
            }
        )
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        items.append(
            {
                "id": f"fc_{suffix}_{index}",
                "type": "function_call",
                "status": "completed",
                "call_id": call.get("id"),
                "name": function.get("name"),
                "arguments": function.get("arguments"),
            }
        )
    return items


@dataclass
class ResponseReply:
    """One token-mode answer; `json()` and `sse()` are its two wire forms.

    `finish_reason` is the chat-side reason the call records: `length` answers
    `status: incomplete` with `incomplete_details.reason: max_output_tokens`.
    """

    request: ResponsesRequest
    model: str
    message: dict[str, Any]
    finish_reason: str
    input_tokens: int
    output_tokens: int
    reasoning_tokens: int
    created_at: int
    id: str = field(default_factory=lambda: new_id("resp"))
    items: list[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.items = output_items(self.message, self.id)

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def body(self, *, final: bool = True) -> dict[str, Any]:
        """The response object; `final=False` is its in-progress form for the first events."""
        request = self.request.body
        response: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status if final else "in_progress",
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": self.items if final else [],
            "tools": request.get("tools") or [],
            "store": self.request.store,
            "usage": self.usage() if final else None,
        }
        for key, default in ECHOED.items():
            value = request.get(key)
            response[key] = default if value is None else value
        if final and self.status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        return response

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }

    def json(self) -> bytes:
        return orjson.dumps(self.body())

    def sse(self) -> bytes:
        """The whole synthesised event stream, each event with its `sequence_number`."""
        return b"".join(
            sse_event(kind, seq, data) for seq, (kind, data) in enumerate(self._events())
        )

    def _events(self) -> Iterator[tuple[str, dict[str, Any]]]:
        opening = self.body(final=False)
        yield "response.created", {"response": opening}
        yield "response.in_progress", {"response": opening}
        for index, item in enumerate(self.items):
            yield from _item_events(index, item)
        yield f"response.{self.status}", {"response": self.body()}


def _item_events(index: int, item: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """added, the item's deltas and dones, then done: what the SDK stream helpers fold."""
    at = {"item_id": item["id"], "output_index": index}
    kind = item["type"]
    if kind == "reasoning":
        yield "response.output_item.added", {"output_index": index, "item": {**item, "content": []}}
        for part_index, part in enumerate(item["content"]):
            where = {**at, "content_index": part_index}
            yield "response.reasoning_text.delta", {**where, "delta": part["text"]}
            yield "response.reasoning_text.done", {**where, "text": part["text"]}
    elif kind == "message":
        opening = {**item, "status": "in_progress", "content": []}
        yield "response.output_item.added", {"output_index": index, "item": opening}
        for part_index, part in enumerate(item["content"]):
            where = {**at, "content_index": part_index}
            empty = {**part, "text": ""}
            yield "response.content_part.added", {**where, "part": empty}
            yield "response.output_text.delta", {**where, "delta": part["text"], "logprobs": []}
            yield "response.output_text.done", {**where, "text": part["text"], "logprobs": []}
            yield "response.content_part.done", {**where, "part": part}
    else:
        opening = {**item, "status": "in_progress", "arguments": ""}
        yield "response.output_item.added", {"output_index": index, "item": opening}
        yield "response.function_call_arguments.delta", {**at, "delta": item["arguments"]}
        done = {**at, "name": item["name"], "arguments": item["arguments"]}
        yield "response.function_call_arguments.done", done
    yield "response.output_item.done", {"output_index": index, "item": item}


def sse_event(kind: str, sequence_number: int, data: dict[str, Any]) -> bytes:
    """One SSE event: `event: <type>` and its JSON with `type` and `sequence_number`."""
    payload = orjson.dumps({"type": kind, "sequence_number": sequence_number, **data})
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


def failed_event(response_id: str | None, sequence_number: int, message: str, code: str) -> bytes:
    """`response.failed` for an error after a stream started (D-36); the stream then ends."""
    response = {
        "id": response_id or new_id("resp"),
        "object": "response",
        "status": "failed",
        "error": {"code": code, "message": message},
        "output": [],
    }
    return sse_event("response.failed", sequence_number, {"response": response})

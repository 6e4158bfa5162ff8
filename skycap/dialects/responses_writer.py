"""Responses SSE written as a token-mode reply is generated, item by item.

The events joined are what `response_sse` writes for the same reply: `response.created`
and `response.in_progress`, the reasoning item (its text deltas as they come, then the
item with skycap's `encrypted_content` when the thinking ends), the message item's
output-text deltas, each function call item whole once parsed, then
`response.completed` (or `response.incomplete`). A failure is `response.failed`; a
keep-alive is the API's own `keepalive` event.
"""

from __future__ import annotations

from typing import Any

from skycap.dialects import ReplyData
from skycap.dialects.responses_reply import (
    _item_events,
    new_id,
    output_items,
    response_object,
    sse_event,
)


class ResponsesWriter:
    """One streamed Responses reply."""

    def __init__(self, head: ReplyData) -> None:
        self._head = head
        self._seq = 0
        self._index = 0
        self._open: str | None = None  # "reasoning" or "message"
        self._done: set[str] = set()
        self._reasoning_id = new_id("rs")
        self._text: list[str] = []

    def start(self) -> bytes:
        opening = response_object(self._head, final=False)
        return self._events(
            [
                ("response.created", {"response": opening}),
                ("response.in_progress", {"response": opening}),
            ]
        )

    def delta(self, part: str, text: str) -> bytes:
        if not text:
            return b""
        kind = "reasoning" if part == "reasoning" else "message"
        events: list[tuple[str, dict[str, Any]]] = []
        if self._open != kind:
            events.extend(self._close_message())
            events.extend(self._open_item(kind))
        at = {"item_id": self._item_id(kind), "output_index": self._index, "content_index": 0}
        if kind == "reasoning":
            events.append(("response.reasoning_text.delta", {**at, "delta": text}))
        else:
            self._text.append(text)
            events.append(("response.output_text.delta", {**at, "delta": text, "logprobs": []}))
        return self._events(events)

    def reasoning_done(self, message: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """Finish the reasoning item with its issued `encrypted_content`, under the id it
        streamed with; the message returned carries that id (it is what gets stored)."""
        issued = (message.get("reasoning_items") or [None])[0]
        if issued is not None:
            issued = {**issued, "id": self._reasoning_id}
            message = {**message, "reasoning_items": [issued]}
        items = [i for i in output_items(message, self._head.id) if i["type"] == "reasoning"]
        events: list[tuple[str, dict[str, Any]]] = []
        if self._open == "reasoning" and items:
            item = items[0]
            at = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
            text = item["content"][0]["text"]
            events.append(("response.reasoning_text.done", {**at, "text": text}))
            events.append(
                ("response.output_item.done", {"output_index": self._index, "item": item})
            )
            self._open = None
            self._index += 1
        elif self._open is None and "reasoning" not in self._done:
            for item in items:
                events.extend(_item_events(self._index, item))
                self._index += 1
        self._done.add("reasoning")
        return self._events(events), message

    def end(self, reply: ReplyData) -> bytes:
        final = response_object(reply)
        events = list(self._close_message(final["output"]))
        for item in final["output"]:
            kind = item["type"]
            if kind in self._done:
                continue
            events.extend(_item_events(self._index, item))
            self._index += 1
        events.append((f"response.{final['status']}", {"response": final}))
        return self._events(events)

    def error(self, status: int, message: str) -> bytes:
        failed = response_object(self._head, final=False)
        code = "server_error" if status >= 500 else "invalid_request"
        failed |= {"status": "failed", "error": {"code": code, "message": message}}
        return self._events([("response.failed", {"response": failed})])

    def keepalive(self) -> bytes:
        """The Responses API's own `keepalive` event: Codex's idle timer counts events, and
        an SSE comment is no event; the SDKs skip the type."""
        return self._events([("keepalive", {})])

    def _item_id(self, kind: str) -> str:
        if kind == "reasoning":
            return self._reasoning_id
        return f"msg_{self._head.id.removeprefix('resp_')}"

    def _open_item(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        self._open = kind
        item_id = self._item_id(kind)
        if kind == "reasoning":
            item = {"id": item_id, "type": "reasoning", "summary": [], "content": []}
            return [("response.output_item.added", {"output_index": self._index, "item": item})]
        item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress"}
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        at = {"item_id": item_id, "output_index": self._index, "content_index": 0}
        return [
            ("response.output_item.added", {"output_index": self._index, "item": item}),
            ("response.content_part.added", {**at, "part": part}),
        ]

    def _close_message(
        self, output: list[dict[str, Any]] | None = None
    ) -> list[tuple[str, dict[str, Any]]]:
        """Finish a streamed message item (with the final output's item when known)."""
        if self._open != "message":
            return []
        item_id = self._item_id("message")
        final = next((i for i in output or () if i["id"] == item_id), None)
        text = "".join(self._text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        if final is None:
            final = {
                "id": item_id,
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [part],
            }
        at = {"item_id": item_id, "output_index": self._index, "content_index": 0}
        self._open = None
        self._done.add("message")
        self._index += 1
        return [
            ("response.output_text.done", {**at, "text": text, "logprobs": []}),
            ("response.content_part.done", {**at, "part": final["content"][0]}),
            ("response.output_item.done", {"output_index": at["output_index"], "item": final}),
        ]

    def _events(self, events: list[tuple[str, dict[str, Any]]]) -> bytes:
        out = []
        for kind, data in events:
            out.append(sse_event(kind, self._seq, data))
            self._seq += 1
        return b"".join(out)

"""Anthropic Messages SSE written as a token-mode reply is generated, block by block.

The events joined are what `MessagesDialect.reply_sse` writes for the same reply:
`message_start`, a thinking block (its deltas as they come, then skycap's signature when
the thinking ends), a text block, each `tool_use` block whole once parsed,
`message_delta` and `message_stop`. Keep-alives are `ping` events.
"""

from __future__ import annotations

from typing import Any

from skycap.dialects import ReplyData
from skycap.dialects.messages_reply import (
    anthropic_error,
    block_frames,
    content_blocks,
    frame,
    message_object,
    reply_stop,
)

KEEPALIVE = b'event: ping\ndata: {"type":"ping"}\n\n'


class MessagesWriter:
    """One streamed Messages reply."""

    def __init__(self, head: ReplyData) -> None:
        self._head = head
        self._index = 0
        self._open: str | None = None  # the block type being streamed
        self._done: set[str] = set()  # block types already sent (thinking, text)

    def start(self) -> bytes:
        start = message_object(self._head, [], None, None)
        start["usage"]["output_tokens"] = 0
        return frame("message_start", {"message": start})

    def delta(self, part: str, text: str) -> bytes:
        if not text:
            return b""
        kind = "thinking" if part == "reasoning" else "text"
        frames = []
        if self._open != kind:
            frames.append(self._close())
            opening = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            frames.append(frame("content_block_start", self._at(content_block=opening)))
            self._open = kind
        delta = {"type": f"{kind}_delta", kind: text}
        frames.append(frame("content_block_delta", self._at(delta=delta)))
        return b"".join(frames)

    def reasoning_done(self, message: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """Close the thinking block with its signature (or send it whole if none streamed)."""
        blocks = [
            b for b in content_blocks(message) if b["type"] in ("thinking", "redacted_thinking")
        ]
        frames = []
        if self._open == "thinking":
            signature = blocks[0].get("signature") if blocks else None
            if signature:
                delta = {"type": "signature_delta", "signature": signature}
                frames.append(frame("content_block_delta", self._at(delta=delta)))
            frames.append(self._close())
        elif "thinking" not in self._done:
            for block in blocks:
                frames.extend(block_frames(self._index, block))
                self._index += 1
        self._done.add("thinking")
        return b"".join(frames), message

    def end(self, reply: ReplyData) -> bytes:
        frames = [self._close()]
        for block in content_blocks(reply.message):
            kind = block["type"]
            if kind in self._done or (kind == "redacted_thinking" and "thinking" in self._done):
                continue
            frames.extend(block_frames(self._index, block))
            self._index += 1
        delta = {"stop_reason": reply_stop(reply), "stop_sequence": reply.stop_sequence}
        usage = {"output_tokens": reply.completion_tokens}
        frames.append(frame("message_delta", {"delta": delta, "usage": usage}))
        frames.append(frame("message_stop", {}))
        return b"".join(frames)

    def error(self, status: int, message: str) -> bytes:
        """An `error` event: the Anthropic SDK raises it as an API error."""
        return b"event: error\ndata: " + anthropic_error(status, message) + b"\n\n"

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def _at(self, **fields: Any) -> dict[str, Any]:
        return {"index": self._index, **fields}

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        stop = frame("content_block_stop", {"index": self._index})
        self._done.add(self._open)
        self._open = None
        self._index += 1
        return stop

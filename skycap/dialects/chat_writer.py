"""Chat Completions SSE written as a token-mode reply is generated: chunk by chunk, then the end.

The chunks joined are the buffered stream `ChatDialect.reply_sse` writes for the same
reply: a role chunk, reasoning and content deltas, each tool call whole (once parsed),
the finish chunk, the usage chunk when `stream_options.include_usage` asks, `[DONE]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from skycap.dialects import ReplyData
from skycap.dialects.chat import _head, _include_usage, _usage, openai_error

KEEPALIVE = b": keep-alive\n\n"


class ChatWriter:
    """One streamed Chat Completions reply; `reasoning_keys` are the answered reasoning keys."""

    def __init__(self, head: ReplyData, reasoning_keys: Sequence[str]) -> None:
        self._head = _head(head, "chat.completion.chunk")
        self._reasoning_keys = tuple(reasoning_keys)

    def _frame(self, delta: dict[str, Any], reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
        return b"data: " + orjson.dumps({**self._head, "choices": [choice]}) + b"\n\n"

    def start(self) -> bytes:
        return self._frame({"role": "assistant"})

    def delta(self, part: str, text: str) -> bytes:
        if part == "reasoning":
            return self._frame(dict.fromkeys(self._reasoning_keys, text)) if text else b""
        return self._frame({"content": text}) if text else b""

    def reasoning_done(self, message: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """Chat has no reasoning item to close; the message is kept as issued."""
        return b"", message

    def end(self, reply: ReplyData) -> bytes:
        frames = [
            self._frame({"tool_calls": [{"index": index, **call}]})
            for index, call in enumerate(reply.message.get("tool_calls") or ())
        ]
        frames.append(self._frame({}, reply.finish_reason))
        if reply.request is not None and _include_usage(reply.request.body):
            usage = {**self._head, "choices": [], "usage": _usage(reply)}
            frames.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        frames.append(b"data: [DONE]\n\n")
        return b"".join(frames)

    def error(self, status: int, message: str) -> bytes:
        """An `error` data event: the OpenAI SDK raises it as an APIError."""
        return b"data: " + openai_error(status, message) + b"\n\n"

    def keepalive(self) -> bytes:
        return KEEPALIVE

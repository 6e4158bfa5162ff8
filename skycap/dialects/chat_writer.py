"""Chat Completions replies as skycap writes them: the error body, reply heads, and the SSE
written as a token-mode reply is generated (chunk by chunk, then the end).

The chunks joined are the buffered stream `ChatDialect.reply_sse` writes for the same
reply: a role chunk, reasoning and content deltas, each tool call whole (once parsed),
the finish chunk, the usage chunk when `stream_options.include_usage` asks, `[DONE]`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from skycap.dialects import ReplyData

KEEPALIVE = b": keep-alive\n\n"


def openai_error(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> bytes:
    """The harness-route error body of http.md §1 (SDKs read `error.message`, `code`, `param`)."""
    kind = "api_error" if status >= 500 else "invalid_request_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def usage_of(reply: ReplyData) -> dict[str, int]:
    """The `usage` object of a reply."""
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def reply_head(reply: ReplyData, kind: str) -> dict[str, Any]:
    """The fields every reply object and chunk opens with; `kind` is its `object`."""
    return {"id": reply.id, "object": kind, "created": reply.created, "model": reply.model}


def include_usage(body: Mapping[str, Any]) -> bool:
    """Whether the request asks for a usage chunk at the end of the stream."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class ChatWriter:
    """One streamed Chat Completions reply; `reasoning_keys` are the answered reasoning keys."""

    def __init__(self, head: ReplyData, reasoning_keys: Sequence[str]) -> None:
        self._head = reply_head(head, "chat.completion.chunk")
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
        if reply.request is not None and include_usage(reply.request.body):
            usage = {**self._head, "choices": [], "usage": usage_of(reply)}
            frames.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        frames.append(b"data: [DONE]\n\n")
        return b"".join(frames)

    def error(self, status: int, message: str) -> bytes:
        """An `error` data event: the OpenAI SDK raises it as an APIError."""
        return b"data: " + openai_error(status, message) + b"\n\n"

    def keepalive(self) -> bytes:
        return KEEPALIVE

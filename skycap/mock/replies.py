"""A scripted reply, and the pieces every scripted upstream cuts its wire shapes from.

`Reply` is what a script answers with in any API (Chat Completions, Messages, Responses);
the helpers give its tool calls with their ids, its finish reason, deterministic usage
counts and text in small pieces, so each API's mock streams the same reply alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODEL = "mock-model"
CREATED = 1_700_000_000
PIECE_CHARS = 8


@dataclass(frozen=True)
class Reply:
    """One scripted answer. `tool_calls` use the OpenAI message shape; ids default to `call_<i>`.

    `finish_reason` defaults to `tool_calls` when there are tool calls, else `stop`;
    `usage` defaults to deterministic counts derived from the sizes of request and reply.
    `hosted` are items or blocks in the API's own shape (a Responses `web_search_call`,
    Anthropic server-tool or `redacted_thinking` blocks) that the mock sends as given,
    after the reasoning and before the text. A Responses tool call may be
    `{"type": "custom", "id", "custom": {"name", "input"}}` and carry a `namespace`.
    """

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    hosted: list[dict[str, Any]] | None = None


ReplySpec = Reply | Mapping[str, Any]


def echo_reply(body: Mapping[str, Any]) -> Reply:
    """The default answer: `echo: ` + the last user message's text, deterministic and cheap."""
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            return Reply(content=f"echo: {text_of(message.get('content'))}")
    return Reply(content="echo")


def text_of(content: Any) -> str:
    """The text of a message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def as_reply(spec: ReplySpec) -> Reply:
    """A script's answer as a `Reply` (a mapping holds its fields)."""
    if isinstance(spec, Reply):
        return spec
    if isinstance(spec, Mapping):
        return Reply(**spec)
    raise TypeError(f"a scripted reply must be a Reply or a mapping, got {type(spec).__name__}")


def pieces(text: str) -> list[str]:
    """`text` in the small pieces a stream sends it in (one empty piece for no text)."""
    return [text[i : i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)] or [""]


def reply_tool_calls(reply: Reply) -> list[dict[str, Any]]:
    """The reply's tool calls in the OpenAI shape, each with an id (`call_<i>` by default)."""
    calls = []
    for i, call in enumerate(reply.tool_calls or []):
        function = call.get("function") or {}
        calls.append(
            {
                "id": call.get("id") or f"call_{i}",
                "type": "function",
                "function": {
                    "name": function.get("name", ""),
                    "arguments": function.get("arguments", ""),
                },
            }
        )
    return calls


def reply_finish_reason(reply: Reply) -> str:
    """The reply's finish reason: as scripted, else `tool_calls` or `stop`."""
    return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")


def reply_usage(reply: Reply, request_size: int) -> dict[str, Any]:
    """The scripted usage, else counts derived from the request's and the reply's sizes."""
    if reply.usage is not None:
        return reply.usage
    produced = len(reply.content or "") + len(reply.reasoning_content or "")
    produced += sum(len(c["function"]["arguments"]) for c in reply_tool_calls(reply))
    prompt, completion = request_size // 4, produced // 4 + 1
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }

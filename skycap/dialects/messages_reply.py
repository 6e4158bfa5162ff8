"""Anthropic Messages replies as skycap answers them: content blocks, SSE events, errors.

Both the whole reply (`MessagesDialect.reply_json` / `reply_sse`) and the stream written
as it is generated (`messages_writer`) are cut from these pieces, so the two agree.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from skycap.dialects import ReplyData

#: The error `type` an Anthropic SDK expects for each status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    407: "authentication_error",
    410: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
#: Canonical (chat) finish reasons as Anthropic stop reasons.
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def arguments_json(value: Any) -> str:
    """A tool call's input as its canonical `arguments` string: compact JSON, raw UTF-8.

    It is the renderer's spelling of parsed arguments, so a token-mode reply and its
    replay agree byte for byte.
    """
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def anthropic_error(status: int, message: str, code: str | None = None) -> bytes:
    """The Anthropic error body, as the SDK reads it (http.md §1): `{"type": "error", "error":
    {type, message, code}}`."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps(
        {"type": "error", "error": {"type": kind, "message": message, "code": code}}
    )


def stop_reason(finish_reason: str) -> str:
    return _STOP_REASONS.get(finish_reason, finish_reason)


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The Anthropic content list of a canonical assistant message skycap answers."""
    blocks: list[dict[str, Any]] = []
    for entry in message.get("thinking_blocks") or ():
        blocks.append(dict(entry))
    content = message.get("content")
    if isinstance(content, str) and content:
        blocks.append({"type": "text", "text": content})
    elif isinstance(content, list):
        blocks.extend(dict(p) for p in content)
    for call in message.get("tool_calls") or ():
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = {"arguments": function["arguments"]}
        blocks.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments}
        )
    return blocks


def message_object(
    reply: ReplyData, content: list[dict[str, Any]], stop: Any, sequence: str | None
) -> dict[str, Any]:
    """The `message` object of a reply: its head, `content` blocks and usage."""
    return {
        "id": reply.id,
        "type": "message",
        "role": "assistant",
        "model": reply.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": reply.prompt_tokens,
            "output_tokens": reply.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def models_listing(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped model list (`{"data": [{"id"}]}`) in Anthropic's shape, else as is."""
    try:
        listing = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    data = listing.get("data") if isinstance(listing, dict) else None
    if status != 200 or not isinstance(data, list):
        return body
    models = [
        {
            "type": "model",
            "id": entry["id"],
            "display_name": entry["id"],
            "created_at": "1970-01-01T00:00:00Z",
        }
        for entry in data
        if isinstance(entry, dict) and isinstance(entry.get("id"), str)
    ]
    first = models[0]["id"] if models else None
    last = models[-1]["id"] if models else None
    return orjson.dumps({"data": models, "has_more": False, "first_id": first, "last_id": last})


def reply_stop(reply: ReplyData) -> str:
    """The answered `stop_reason`: `stop_sequence` when a stop sequence ended the reply."""
    if reply.stop_sequence is not None:
        return "stop_sequence"
    return stop_reason(reply.finish_reason)


def frame(kind: str, payload: dict[str, Any]) -> bytes:
    """One SSE event: its `event:` line names the `type` its data carries."""
    data = orjson.dumps({"type": kind, **payload})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def block_frames(index: int, block: dict[str, Any]) -> list[bytes]:
    """A whole content block as its start, delta and stop events."""
    kind = block["type"]
    if kind == "thinking":
        opening = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": block["thinking"]}]
        if block.get("signature"):
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
    elif kind == "text":
        opening, deltas = (
            {"type": "text", "text": ""},
            [{"type": "text_delta", "text": block["text"]}],
        )
    elif kind == "tool_use":
        opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": arguments_json(block["input"])}]
    else:
        opening, deltas = block, []
    frames = [frame("content_block_start", {"index": index, "content_block": opening})]
    frames += [frame("content_block_delta", {"index": index, "delta": d}) for d in deltas]
    frames.append(frame("content_block_stop", {"index": index}))
    return frames

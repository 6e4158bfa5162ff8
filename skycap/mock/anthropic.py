"""Scripted Anthropic Messages server on a real socket, with the OpenAI mock's faults.

`ScriptedAnthropicUpstream` is `ScriptedUpstream` speaking Messages: `POST /v1/messages`
(JSON or SSE in pieces: `message_start`, a `ping`, thinking with its `signature_delta`,
text, `tool_use` with `input_json_delta` pieces, `message_delta`, `message_stop`) and
`POST /v1/messages/count_tokens`. Scripts, `fail_next` faults (status, garbage, no reply,
hang, a stream broken mid-way, sleep) and `requests` work as there; a `Reply`'s
`reasoning_content` is answered as a thinking block signed `sig-<n>`, its `hosted` blocks
(`redacted_thinking`, a server tool's `server_tool_use` and `web_search_tool_result`) as
given after it, its OpenAI-shaped `tool_calls` as `tool_use` blocks with `toolu_mock_<i>`
ids. Streamed, a `server_tool_use` input comes in `input_json_delta` pieces as a
`tool_use`'s does; other hosted blocks come whole in their `content_block_start`.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from skycap.dialects.messages import anthropic_error, stop_reason
from skycap.mock.replies import MODEL, Reply, pieces, reply_spans
from skycap.mock.upstream import ScriptedUpstream


def message_blocks(reply: Reply, reply_id: str) -> list[dict[str, Any]]:
    """The Anthropic content blocks of a scripted reply."""
    blocks: list[dict[str, Any]] = []
    if reply.reasoning_content is not None:
        signature = f"sig-{reply_id}"
        blocks.append(
            {"type": "thinking", "thinking": reply.reasoning_content, "signature": signature}
        )
    blocks += reply.hosted or []
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for i, call in enumerate(reply.tool_calls or ()):
        function = call.get("function") or {}
        arguments = function.get("arguments") or "{}"
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_mock_{i}",
                "name": function.get("name", ""),
                "input": json.loads(arguments),
            }
        )
    return blocks


def _usage(reply: Reply, request_size: int) -> dict[str, Any]:
    if reply.usage is not None:
        return reply.usage
    produced = len(reply.content or "") + len(reply.reasoning_content or "")
    return {"input_tokens": request_size // 4, "output_tokens": produced // 4 + 1}


def _stop(reply: Reply) -> str:
    if reply.finish_reason is not None:
        return stop_reason(reply.finish_reason)
    return "tool_use" if reply.tool_calls else "end_turn"


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"
    )


class ScriptedAnthropicUpstream(ScriptedUpstream):
    """A mock Anthropic Messages server at `start()`'s base URL (ends in `/v1`)."""

    CALL_PATH = "/v1/messages"
    ID_PREFIX = "msg_mock"

    def _other_route(self, method: str, path: str, body: bytes) -> bytes | None:
        if method == "POST" and path == "/v1/messages/count_tokens":
            return orjson.dumps({"input_tokens": len(body) // 4})
        return None

    def _error_body(self, status: int, message: str) -> bytes:
        return anthropic_error(status, message)

    def _message(
        self, reply: Reply, model: str, reply_id: str, request_size: int
    ) -> dict[str, Any]:
        return {
            "id": reply_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": message_blocks(reply, reply_id),
            "stop_reason": _stop(reply),
            "stop_sequence": None,
            "usage": _usage(reply, request_size),
            **reply_spans(reply),
        }

    def _reported(self, reply: Reply, body: dict[str, Any]) -> Reply:
        """A server that reports weight versions on this wire sends them unasked."""
        return reply

    def _reply_body(self, reply: Reply, *, model: str, reply_id: str, request_size: int) -> bytes:
        return orjson.dumps(self._message(reply, model, reply_id, request_size))

    def _reply_events(
        self, reply: Reply, *, model: str, reply_id: str, request_size: int, body: dict[str, Any]
    ) -> list[bytes]:
        """Each event a separate write; text, thinking and input JSON in small pieces."""
        message = self._message(reply, model, reply_id, request_size)
        usage = message["usage"]
        start = {**message, "content": [], "stop_reason": None}
        start.pop("weight_versions", None)
        start["usage"] = {**usage, "output_tokens": 1}
        events = [_event("message_start", {"message": start}), _event("ping", {})]
        for index, block in enumerate(message["content"]):
            events += _block_events(index, block)
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": None, **reply_spans(reply)}
        output = {"output_tokens": usage.get("output_tokens", 0)}
        events.append(_event("message_delta", {"delta": delta, "usage": output}))
        events.append(_event("message_stop", {}))
        return events

    def _no_choices(self, stream: bool) -> list[bytes] | bytes:
        head = {"id": "msg_mock-empty", "type": "message", "role": "assistant", "model": MODEL}
        if stream:
            return [_event("message_start", {"message": head}), _event("message_stop", {})]
        return orjson.dumps(head)


def _block_events(index: int, block: dict[str, Any]) -> list[bytes]:
    kind = block["type"]
    if kind == "thinking":
        opening = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": p} for p in pieces(block["thinking"])]
        deltas.append({"type": "signature_delta", "signature": block["signature"]})
    elif kind == "text":
        opening = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": p} for p in pieces(block["text"])]
    elif kind not in ("tool_use", "server_tool_use"):
        opening, deltas = block, []
    else:
        opening = {"type": kind, "id": block["id"], "name": block["name"], "input": {}}
        arguments = json.dumps(block["input"])
        deltas = [{"type": "input_json_delta", "partial_json": p} for p in pieces(arguments)]
    events = [_event("content_block_start", {"index": index, "content_block": opening})]
    events += [_event("content_block_delta", {"index": index, "delta": d}) for d in deltas]
    events.append(_event("content_block_stop", {"index": index}))
    return events

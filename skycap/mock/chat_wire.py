"""OpenAI Chat Completions' wire shapes for a scripted reply: the JSON body and the SSE events."""

from __future__ import annotations

from typing import Any

import orjson

from skycap.mock.replies import (
    CREATED,
    MODEL,
    Reply,
    pieces,
    reply_finish_reason,
    reply_spans,
    reply_tool_calls,
    reply_usage,
)


def chat_message(reply: Reply) -> dict[str, Any]:
    """The reply as an assistant message in the Chat Completions shape."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning_content is not None:
        message["reasoning_content"] = reply.reasoning_content
    if reply.tool_calls:
        message["tool_calls"] = reply_tool_calls(reply)
    return message


def completion_body(reply: Reply, *, model: str, reply_id: str, request_size: int) -> bytes:
    """The non-streamed `chat.completion` JSON for `reply`."""
    return orjson.dumps(
        {
            "id": reply_id,
            "object": "chat.completion",
            "created": CREATED,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": chat_message(reply),
                    "finish_reason": reply_finish_reason(reply),
                    "logprobs": None,
                    # chat_completion/protocol.py ChatCompletionResponseChoice (vLLM 0.33)
                    **reply_spans(reply),
                }
            ],
            "usage": reply_usage(reply, request_size),
        }
    )


def stream_events(
    reply: Reply, *, model: str, reply_id: str, request_size: int, include_usage: bool
) -> list[bytes]:
    """The SSE events for `reply`, each a separate write: role, reasoning and content pieces,
    each tool call as id+name then argument pieces, finish, usage (only when the request
    set `stream_options.include_usage`, as OpenAI does), then `[DONE]`."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if finish is not None:  # vLLM sets them on the finishing chunk only
            choice.update(reply_spans(reply))
        return sse_event(head | {"choices": [choice]})

    head = {"id": reply_id, "object": "chat.completion.chunk", "created": CREATED, "model": model}
    events = [chunk({"role": "assistant"})]
    if reply.reasoning_content:
        events += [chunk({"reasoning_content": p}) for p in pieces(reply.reasoning_content)]
    if reply.content is not None:
        events += [chunk({"content": p}) for p in pieces(reply.content)]
    for i, call in enumerate(reply_tool_calls(reply)):
        function = call["function"]
        opening = {"index": i, "id": call["id"], "type": "function"}
        opening["function"] = {"name": function["name"], "arguments": ""}
        events.append(chunk({"tool_calls": [opening]}))
        for piece in pieces(function["arguments"]):
            events.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
    events.append(chunk({}, reply_finish_reason(reply)))
    if include_usage:
        events.append(sse_event(head | {"choices": [], "usage": reply_usage(reply, request_size)}))
    events.append(b"data: [DONE]\n\n")
    return events


def sse_event(payload: Any) -> bytes:
    """One SSE `data:` event of a JSON payload."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def model_entry() -> dict[str, Any]:
    """The scripted model's entry in `GET /v1/models`."""
    return {"id": MODEL, "object": "model", "created": CREATED, "owned_by": "skycap-mock"}

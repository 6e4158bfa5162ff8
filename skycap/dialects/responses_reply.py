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
from typing import Any

import orjson

from skycap.dialects import ReplyData
from skycap.dialects.responses_tools import Tools, custom_input

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


def output_items(
    message: dict[str, Any], response_id: str, tools: Tools | None = None
) -> list[dict[str, Any]]:
    """The output items of an assistant message: reasoning, the message, function calls.

    The reasoning item is the one token mode issued (`reasoning_items`: its id and opaque
    `encrypted_content`); other item ids derive from `response_id`, so the same reply
    always has the same items. A call of a custom tool in `tools` (the request's) is a
    `custom_tool_call` whose input is the call's `input` argument; a namespace member's
    call names its member and namespace apart.
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
        items.append(_call_item(call, f"{suffix}_{index}", tools or Tools()))
    return items


def _call_item(call: dict[str, Any], suffix: str, tools: Tools) -> dict[str, Any]:
    function = call.get("function") or {}
    name, arguments = function.get("name"), function.get("arguments")
    namespace, member = tools.members.get(name, (None, name))
    if name in tools.custom:
        item = {"id": f"ctc_{suffix}", "type": "custom_tool_call", "status": "completed"}
        item |= {"call_id": call.get("id"), "name": member, "input": custom_input(arguments)}
    else:
        item = {"id": f"fc_{suffix}", "type": "function_call", "status": "completed"}
        item |= {"call_id": call.get("id"), "name": member, "arguments": arguments}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def request_tools(reply: ReplyData) -> Tools | None:
    """The tools the reply's request declared (how its calls are written)."""
    return reply.request.extras.get("tools") if reply.request is not None else None


def response_object(reply: ReplyData, *, final: bool = True) -> dict[str, Any]:
    """The response object for `reply`; `final=False` is its in-progress form.

    `length` answers `status: incomplete` with `incomplete_details.reason:
    max_output_tokens`; the request's own fields (tools, instructions, sampling) are echoed.
    """
    request = reply.request.body if reply.request is not None else {}
    incomplete = reply.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    response: dict[str, Any] = {
        "id": reply.id,
        "object": "response",
        "created_at": reply.created,
        "status": status if final else "in_progress",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if final and incomplete else None,
        "model": reply.model,
        "output": output_items(reply.message, reply.id, request_tools(reply)) if final else [],
        "tools": request.get("tools") or [],
        "store": request.get("store") is not False,
        "usage": usage(reply) if final else None,
    }
    for key, default in ECHOED.items():
        value = request.get(key)
        response[key] = default if value is None else value
    return response


def usage(reply: ReplyData) -> dict[str, Any]:
    return {
        "input_tokens": reply.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": reply.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reply.reasoning_tokens},
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def response_sse(reply: ReplyData) -> bytes:
    """The whole synthesised event stream, each event with its `sequence_number`."""
    final = response_object(reply)
    opening = response_object(reply, final=False)
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": opening}),
        ("response.in_progress", {"response": opening}),
    ]
    for index, item in enumerate(final["output"]):
        events.extend(_item_events(index, item))
    events.append((f"response.{final['status']}", {"response": final}))
    return b"".join(sse_event(kind, seq, data) for seq, (kind, data) in enumerate(events))


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
    elif kind == "custom_tool_call":
        opening = {**item, "status": "in_progress", "input": ""}
        yield "response.output_item.added", {"output_index": index, "item": opening}
        yield "response.custom_tool_call_input.delta", {**at, "delta": item["input"]}
        yield "response.custom_tool_call_input.done", {**at, "input": item["input"]}
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

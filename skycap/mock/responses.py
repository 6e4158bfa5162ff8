"""A scripted OpenAI Responses API server (`POST /v1/responses`) for text-mode tests.

It is ScriptedUpstream speaking Responses, with the same scripts (`Reply` or mappings),
request log and faults (`fail_next`). Streams carry every event with its
`sequence_number`, text and arguments in small pieces. Responses are kept by id as a
store-enabled server keeps them: `previous_response_id` must name one (else 404, as vLLM
and OpenAI answer), and `GET /v1/responses/{id}` returns it. `POST
/v1/responses/compact` answers the compacted history (`compacted`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import orjson

from skycap.dialects.chat import openai_error
from skycap.mock.h11_io import send_json
from skycap.mock.replies import (
    CREATED,
    MODEL,
    Reply,
    pieces,
    reply_spans,
    reply_tool_calls,
    reply_usage,
    text_of,
)
from skycap.mock.upstream import ScriptedUpstream

_PATH = "/v1/responses"


def echo_response(body: dict[str, Any]) -> Reply:
    """The default answer: `echo: ` + the last user message's text in `input`."""
    value = body.get("input")
    if isinstance(value, str):
        return Reply(content=f"echo: {value}")
    for item in reversed(value if isinstance(value, list) else []):
        if isinstance(item, dict) and item.get("role") == "user":
            return Reply(content=f"echo: {text_of(item.get('content'))}")
    return Reply(content="echo")


def output_items(reply: Reply, number: int | str) -> list[dict[str, Any]]:
    """The output items of `reply`: reasoning (with an opaque encrypted_content), its
    hosted items, the message, then one function_call (or custom_tool_call) per tool call."""
    items: list[dict[str, Any]] = []
    if reply.reasoning_content is not None:
        items.append(
            {
                "id": f"rs_mock{number}",
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reply.reasoning_content}],
                "encrypted_content": f"mock-encrypted-{number}",
            }
        )
    items += reply.hosted or []
    if reply.content is not None:
        part = {"type": "output_text", "text": reply.content, "annotations": []}
        items.append(
            {
                "id": f"msg_mock{number}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [part],
            }
        )
    for call, scripted in zip(reply_tool_calls(reply), reply.tool_calls or [], strict=True):
        item: dict[str, Any] = {"id": f"fc_mock{number}_{len(items)}", "status": "completed"}
        if scripted.get("type") == "custom":
            custom = scripted["custom"]
            item |= {"type": "custom_tool_call", "call_id": call["id"]}
            item |= {"name": custom["name"], "input": custom["input"]}
        else:
            item |= {"type": "function_call", "call_id": call["id"]}
            item |= {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
        if "namespace" in scripted:
            item["namespace"] = scripted["namespace"]
        items.append(item)
    return items


def response_usage(reply: Reply, request_size: int) -> dict[str, Any]:
    """Responses-shaped usage (input/output tokens, reasoning tokens) for `reply`."""
    if reply.usage is not None:
        return reply.usage
    chat = reply_usage(reply, request_size)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": len(reply.reasoning_content or "") // 4},
        "total_tokens": chat["total_tokens"],
    }


def response_object(
    reply: Reply,
    body: dict[str, Any],
    *,
    response_id: str,
    number: int | str,
    request_size: int,
) -> dict[str, Any]:
    """The completed (or, for `finish_reason="length"`, incomplete) response object."""
    incomplete = reply.finish_reason == "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": CREATED,
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "model": body.get("model") if isinstance(body.get("model"), str) else MODEL,
        "output": output_items(reply, number),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True),
        "temperature": body.get("temperature"),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "usage": response_usage(reply, request_size),
        **reply_spans(reply),
    }


def stream_events(response: dict[str, Any]) -> list[bytes]:
    """The SSE events of `response`, each a separate write with its `sequence_number`."""
    numbers = itertools.count()

    def event(kind: str, **data: Any) -> bytes:
        payload = orjson.dumps({"type": kind, "sequence_number": next(numbers), **data})
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    opening = {**response, "status": "in_progress", "output": [], "usage": None}
    opening.pop("weight_versions", None)  # the finished response carries them
    events = [event("response.created", response=opening)]
    events.append(event("response.in_progress", response=opening))
    for index, item in enumerate(response["output"]):
        events += [event(kind, **data) for kind, data in _item_events(index, item)]
    events.append(event(f"response.{response['status']}", response=response))
    return events


def _item_events(index: int, item: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "reasoning":
        yield "response.output_item.added", {"output_index": index, "item": {**item, "content": []}}
        text = item["content"][0]["text"]
        where = {**at, "content_index": 0}
        for piece in pieces(text):
            yield "response.reasoning_text.delta", {**where, "delta": piece}
        yield "response.reasoning_text.done", {**where, "text": text}
    elif item["type"] == "message":
        opening = {**item, "status": "in_progress", "content": []}
        yield "response.output_item.added", {"output_index": index, "item": opening}
        part = item["content"][0]
        where = {**at, "content_index": 0}
        yield "response.content_part.added", {**where, "part": {**part, "text": ""}}
        for piece in pieces(part["text"]):
            yield "response.output_text.delta", {**where, "delta": piece, "logprobs": []}
        yield "response.output_text.done", {**where, "text": part["text"], "logprobs": []}
        yield "response.content_part.done", {**where, "part": part}
    elif item["type"] == "custom_tool_call":
        opening = {**item, "status": "in_progress", "input": ""}
        yield "response.output_item.added", {"output_index": index, "item": opening}
        for piece in pieces(item["input"]):
            yield "response.custom_tool_call_input.delta", {**at, "delta": piece}
        yield "response.custom_tool_call_input.done", {**at, "input": item["input"]}
    elif item["type"] != "function_call":  # a hosted item (a web search call, …)
        opening = {**item, "status": "in_progress"}
        yield "response.output_item.added", {"output_index": index, "item": opening}
        kind = f"response.{item['type']}"
        yield f"{kind}.in_progress", at
        yield f"{kind}.completed", at
    else:
        opening = {**item, "status": "in_progress", "arguments": ""}
        yield "response.output_item.added", {"output_index": index, "item": opening}
        for piece in pieces(item["arguments"]):
            yield "response.function_call_arguments.delta", {**at, "delta": piece}
        done = {**at, "name": item["name"], "arguments": item["arguments"]}
        yield "response.function_call_arguments.done", done
    yield "response.output_item.done", {"output_index": index, "item": item}


class ScriptedResponsesUpstream(ScriptedUpstream):
    """A mock Responses server at `start()`'s base URL (ends in `/v1`).

    Faults work as on ScriptedUpstream: for Responses, `garbage` sends events whose
    payload is not JSON, `no_choices` a stream (or body) with no terminal response, and
    `break_stream` about half of the events before closing the socket. `stored` maps each
    response id to the response, as a store-enabled server keeps it.
    """

    CALL_PATH = _PATH
    ID_PREFIX = "resp_mock"

    def __init__(self, script: Any = None, *, chunk_delay: float = 0.0) -> None:
        super().__init__(script, chunk_delay=chunk_delay)
        self.stored: dict[str, dict[str, Any]] = {}
        self._body: dict[str, Any] = {}

    async def _route(self, conn, reader, writer, request) -> bool:  # type: ignore[override]
        path = request.path.split("?", 1)[0]
        if request.method == "GET" and path.startswith(_PATH + "/"):
            response_id = path[len(_PATH) + 1 :]
            found = self.stored.get(response_id)
            if found is None:
                message = f"Response with id {response_id!r} not found."
                await send_json(conn, writer, 404, openai_error(404, message))
            else:
                await send_json(conn, writer, 200, orjson.dumps(found))
            return True
        if request.method == "POST" and path == _PATH + "/compact":
            await send_json(conn, writer, 200, orjson.dumps(compacted(request.body)))
            return True
        if request.method == "POST" and path == _PATH:
            previous = _previous_id(request.body)
            if previous is not None and previous not in self.stored:
                await send_json(conn, writer, 404, _not_found(previous))
                return True
        return await super()._route(conn, reader, writer, request)

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        # The reply writers below take no body; they answer the call that asked just now
        # (nothing awaits between the two on the server's one event loop).
        self._body = body
        if self._script is None:
            return echo_response(body)
        return super()._next_reply(body)

    def _response(self, reply: Reply, reply_id: str, request_size: int) -> dict[str, Any]:
        body, self._body = self._body, {}
        number = reply_id.removeprefix(self.ID_PREFIX)
        response = response_object(
            reply, body, response_id=reply_id, number=number, request_size=request_size
        )
        if body and body.get("store", True) is not False:
            self.stored[reply_id] = response
        return response

    def _reported(self, reply: Reply, body: dict[str, Any]) -> Reply:
        """A server that reports weight versions on this wire sends them unasked."""
        return reply

    def _reply_body(self, reply: Reply, *, model: str, reply_id: str, request_size: int) -> bytes:
        return orjson.dumps(self._response(reply, reply_id, request_size))

    def _reply_events(
        self, reply: Reply, *, model: str, reply_id: str, request_size: int, body: dict[str, Any]
    ) -> list[bytes]:
        return stream_events(self._response(reply, reply_id, request_size))

    def _no_choices(self, stream: bool) -> list[bytes] | bytes:
        """A stream that ends after `response.in_progress`, or a body with no output."""
        response = response_object(
            Reply(content="never sent"), {}, response_id="resp_mock-empty", number=0, request_size=0
        )
        if stream:
            return stream_events(response)[:2]
        return orjson.dumps({"id": "resp_mock-empty", "object": "response"})


def compacted(raw: bytes) -> dict[str, Any]:
    """`POST /v1/responses/compact`'s answer, as the API gives it: the input's user
    messages, then one opaque `compaction` item standing for the rest."""
    body = orjson.loads(raw)
    items = body.get("input") if isinstance(body, dict) else None
    kept = [
        item
        for item in (items if isinstance(items, list) else [])
        if isinstance(item, dict) and item.get("role") == "user"
    ]
    compaction = {"type": "compaction", "id": "cmp_mock", "encrypted_content": "mock-compaction"}
    return {"object": "response.compaction", "output": [*kept, compaction]}


def _previous_id(raw: bytes) -> Any:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return body.get("previous_response_id") if isinstance(body, dict) else None


def _not_found(previous: Any) -> bytes:
    """OpenAI's answer to an unknown `previous_response_id`."""
    error = {"message": f"Previous response with id '{previous}' not found."}
    error |= {"type": "invalid_request_error", "param": "previous_response_id"}
    error["code"] = "previous_response_not_found"
    return orjson.dumps({"error": error})

"""A scripted OpenAI Responses API server (`POST /v1/responses`) for text-mode tests.

It is a ScriptedUpstream that also answers the Responses route, with the same scripts
(`Reply` or mappings), request log and faults (`fail_next`), so one mock serves chat and
Responses calls alike. Streams carry every event with its `sequence_number`, text and
arguments in small pieces. Responses are kept by id as a store-enabled server keeps them:
`previous_response_id` must name one (else 404, as vLLM and OpenAI answer), and
`GET /v1/responses/{id}` returns it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import h11
import orjson

from skycap.mock.upstream import (
    CREATED,
    MODEL,
    Reply,
    ScriptedUpstream,
    _break_after,
    _Fault,
    _pieces,
    _ScriptError,
    _send_json,
    _text_of,
    _tool_calls,
    _usage,
)
from skycap.wire import openai_error

_PATH = "/v1/responses"


def echo_response(body: dict[str, Any]) -> Reply:
    """The default answer: `echo: ` + the last user message's text in `input`."""
    value = body.get("input")
    if isinstance(value, str):
        return Reply(content=f"echo: {value}")
    for item in reversed(value if isinstance(value, list) else []):
        if isinstance(item, dict) and item.get("role") == "user":
            return Reply(content=f"echo: {_text_of(item.get('content'))}")
    return Reply(content="echo")


def output_items(reply: Reply, number: int) -> list[dict[str, Any]]:
    """The output items of `reply`: reasoning (with an opaque encrypted_content), the
    message, then one function_call per tool call."""
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
    for call in _tool_calls(reply):
        items.append(
            {
                "id": f"fc_mock{number}_{len(items)}",
                "type": "function_call",
                "status": "completed",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            }
        )
    return items


def response_usage(reply: Reply, request_size: int) -> dict[str, Any]:
    """Responses-shaped usage (input/output tokens, reasoning tokens) for `reply`."""
    if reply.usage is not None:
        return reply.usage
    chat = _usage(reply, request_size)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": len(reply.reasoning_content or "") // 4},
        "total_tokens": chat["total_tokens"],
    }


def response_object(
    reply: Reply, body: dict[str, Any], *, response_id: str, number: int, request_size: int
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
    }


def stream_events(response: dict[str, Any]) -> list[bytes]:
    """The SSE events of `response`, each a separate write with its `sequence_number`."""
    numbers = itertools.count()

    def event(kind: str, **data: Any) -> bytes:
        payload = orjson.dumps({"type": kind, "sequence_number": next(numbers), **data})
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    opening = {**response, "status": "in_progress", "output": [], "usage": None}
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
        for piece in _pieces(text):
            yield "response.reasoning_text.delta", {**where, "delta": piece}
        yield "response.reasoning_text.done", {**where, "text": text}
    elif item["type"] == "message":
        opening = {**item, "status": "in_progress", "content": []}
        yield "response.output_item.added", {"output_index": index, "item": opening}
        part = item["content"][0]
        where = {**at, "content_index": 0}
        yield "response.content_part.added", {**where, "part": {**part, "text": ""}}
        for piece in _pieces(part["text"]):
            yield "response.output_text.delta", {**where, "delta": piece, "logprobs": []}
        yield "response.output_text.done", {**where, "text": part["text"], "logprobs": []}
        yield "response.content_part.done", {**where, "part": part}
    else:
        opening = {**item, "status": "in_progress", "arguments": ""}
        yield "response.output_item.added", {"output_index": index, "item": opening}
        for piece in _pieces(item["arguments"]):
            yield "response.function_call_arguments.delta", {**at, "delta": piece}
        done = {**at, "name": item["name"], "arguments": item["arguments"]}
        yield "response.function_call_arguments.done", done
    yield "response.output_item.done", {"output_index": index, "item": item}


class ScriptedResponsesUpstream(ScriptedUpstream):
    """ScriptedUpstream plus `POST /v1/responses` and `GET /v1/responses/{id}`.

    Faults apply to chat and Responses calls alike; for Responses, `garbage` sends
    events whose payload is not JSON, `no_choices` a stream (or body) with no terminal
    response, and `break_stream` about half of the events before closing the socket.
    `stored` maps each response id to the response, as a store-enabled server keeps it.
    """

    def __init__(self, script: Any = None, *, chunk_delay: float = 0.0) -> None:
        super().__init__(script, chunk_delay=chunk_delay)
        self.stored: dict[str, dict[str, Any]] = {}
        self._responses = 0

    async def _route(self, conn, reader, writer, request) -> bool:  # type: ignore[override]
        path = request.path.split("?", 1)[0]
        if request.method == "POST" and path == _PATH:
            return await self._respond(conn, reader, writer, request.body)
        if request.method == "GET" and path.startswith(_PATH + "/"):
            found = self.stored.get(path[len(_PATH) + 1 :])
            if found is None:
                message = f"Response with id {path[len(_PATH) + 1 :]!r} not found."
                await _send_json(conn, writer, 404, openai_error(404, message))
            else:
                await _send_json(conn, writer, 200, orjson.dumps(found))
            return True
        return await super()._route(conn, reader, writer, request)

    async def _respond(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        raw: bytes,
    ) -> bool:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            body, detail = None, f"request body is not JSON: {exc}"
        else:
            detail = "request body must be a JSON object"
        stream = isinstance(body, dict) and body.get("stream") is True
        fault = self._take_fault()
        if fault is not None and fault.kind != "sleep":
            return await self._responses_fault(conn, reader, writer, fault, stream)
        if fault is not None:
            await asyncio.sleep(fault.seconds)
        if not isinstance(body, dict):
            await _send_json(conn, writer, 400, openai_error(400, detail))
            return True
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            message = f"Previous response with id '{previous}' not found."
            error = {"message": message, "type": "invalid_request_error"}
            error |= {"param": "previous_response_id", "code": "previous_response_not_found"}
            await _send_json(conn, writer, 404, orjson.dumps({"error": error}))
            return True
        try:
            reply = self._next_reply(body)
        except _ScriptError as exc:
            await _send_json(conn, writer, 500, openai_error(500, str(exc)))
            return True
        response = self._response(reply, body, len(raw))
        if not stream:
            await _send_json(conn, writer, 200, orjson.dumps(response))
        else:
            await self._send_stream(conn, writer, stream_events(response))
        return True

    def _response(self, reply: Reply, body: dict[str, Any], size: int) -> dict[str, Any]:
        with self._lock:
            self._responses += 1
            number = self._responses
        response_id = f"resp_mock{number}"
        response = response_object(
            reply, body, response_id=response_id, number=number, request_size=size
        )
        if body.get("store", True) is not False:
            self.stored[response_id] = response
        return response

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        if self._script is None and "input" in body:
            return echo_response(body)
        return super()._next_reply(body)

    async def _responses_fault(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        fault: _Fault,
        stream: bool,
    ) -> bool:
        """Answer a Responses call with `fault`; return whether the connection stays usable."""
        if fault.kind in ("status", "hang"):
            return await self._fault(conn, reader, writer, fault, stream)
        reply = Reply(content="this reply is cut off before it ends")
        response = response_object(
            reply, {}, response_id="resp_mock_broken", number=0, request_size=0
        )
        if fault.kind == "break_stream":
            payload = stream_events(response) if stream else [orjson.dumps(response)]
            await _break_after(conn, writer, payload, stream)
            return False
        if fault.kind == "garbage" and stream:
            await self._send_stream(conn, writer, [b"data: <html>not json</html>\n\n"] * 2)
        elif fault.kind == "garbage":
            await _send_json(conn, writer, 200, b"<html>this is not JSON</html>")
        elif stream:  # no_choices: the stream ends without a terminal response
            await self._send_stream(conn, writer, stream_events(response)[:2])
        else:
            await _send_json(conn, writer, 200, orjson.dumps({"id": "resp_mock_empty"}))
        return True

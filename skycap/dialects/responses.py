"""The OpenAI Responses API as a dialect: `DIALECT` reads, answers and assembles it.

Reading lives in `responses_read` (input items into canonical chat messages), the
token-mode writer in `responses_reply`, text mode's reply reader in `responses_stream`.
What token mode issues is here: a reasoning item whose opaque `encrypted_content` holds
the reasoning text and names the completion's tokens, so a harness that sends it back
lands on the exact node. Each call records its reply's id as `response_id`, which
is how a later `previous_response_id` finds its place in the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from skycap.dialects import (
    STORED_REPLY,
    Earlier,
    ReplyData,
    Request,
    Route,
    StreamWriter,
    UnknownReply,
)
from skycap.dialects.responses_read import (
    check_tool_results,
    read_request,
    reasoning_token,
    with_history,
)
from skycap.dialects.responses_reply import new_id, response_object, response_sse, sse_event
from skycap.dialects.responses_stream import ResponsesAssembler, read_response
from skycap.dialects.responses_writer import ResponsesWriter
from skycap.hashing import token_digest


def responses_error(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> bytes:
    """The OpenAI error body a Responses client reads; 404 is `not_found_error`."""
    if status >= 500:
        kind = "api_error"
    elif status == 404:
        kind = "not_found_error"
    else:
        kind = "invalid_request_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


class ResponsesDialect:
    """The Responses API as a `Dialect` (see skycap.dialects)."""

    name = "responses"
    upstream_path = b"/responses"
    weight_versions_request = None  # vLLM's Responses route has no such request field
    reply_id_key = "response_id"
    routes = (
        Route("responses", "POST", "responses", "/v1/responses", websocket=True),
        Route("response-get", "GET", "responses/", "/v1/responses/", STORED_REPLY),
    )
    caller_header = None
    api_host = None
    forced_tool_finish = "tool_calls"

    def read(self, body: Any) -> Request:
        return read_request(body)

    def reply_message(self, parsed: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
        return read_response(parsed)

    def assembler(self) -> ResponsesAssembler:
        return ResponsesAssembler()

    def issue(
        self,
        message: dict[str, Any],
        completion_ids: Sequence[int],
        reasoning_ids: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """Fresh `call_…` ids, and the reasoning item's id and opaque `encrypted_content`.

        Ids are fresh per reply, never derived from the tokens: two replies with the same
        tokens are still two items to a client (the Agents SDK drops an input item, or a
        tool call and its output, whose id or `call_id` it has sent before).
        """
        out = dict(message)
        calls = message.get("tool_calls")
        if calls:
            out["tool_calls"] = [{**call, "id": new_id("call")} for call in calls]
        reasoning = message.get("reasoning_content")
        if reasoning:
            signing = completion_ids if reasoning_ids is None else reasoning_ids
            token = reasoning_token(token_digest(signing), reasoning)
            out["reasoning_items"] = [{"id": new_id("rs"), "encrypted_content": token}]
        return out

    def reply_id(self) -> str:
        return new_id("resp")

    def reply_json(self, reply: ReplyData) -> bytes:
        return orjson.dumps(response_object(reply))

    def reply_sse(self, reply: ReplyData) -> bytes:
        return response_sse(reply)

    def error(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> bytes:
        return responses_error(status, message, code, param)

    def finish_reason(self, canonical_reason: str) -> str:
        return "incomplete" if canonical_reason == "length" else "completed"

    def stream_failure(self, assembler: ResponsesAssembler, message: str) -> bytes:
        """`response.failed` ends a relayed stream that broke: the response the
        stream announced, failed, numbered after the last event the harness got."""
        failed = dict(assembler.response or {"object": "response", "output": []})
        failed |= {"status": "failed", "error": {"code": "server_error", "message": message}}
        event = sse_event("response.failed", assembler.sequence + 1, {"response": failed})
        return assembler.cut() + event

    def stream_writer(self, head: ReplyData, reasoning_keys: Sequence[str]) -> StreamWriter:
        return ResponsesWriter(head)

    def models_listing(self, status: int, body: bytes) -> bytes:
        return body  # OpenAI's model list is this API's too

    def prepare(self, request: Request, earlier: Earlier, renders: bool) -> None:
        """Put the history of the response named by `previous_response_id` into
        `request.messages` (its own `instructions` left out: they do not carry over),
        then check that every tool result answers a call in the whole history.

        Rendering, `developer` messages become `system` ones (chat templates such as
        Qwen3's have no developer role and would drop them; the API means both as
        instructions), are stored so, and the call records `developer_as_system`; and the
        id must be this trajectory's (a 404, as vLLM and OpenAI answer). Forwarding, the
        upstream resolves an id this trajectory never saw, and the call is placed by its
        own input alone.
        """
        if renders and any(m.get("role") == "developer" for m in request.messages):
            request.messages = [
                {**m, "role": "system"} if m.get("role") == "developer" else m
                for m in request.messages
            ]
            request.recorded["developer_as_system"] = True
        previous = request.extras.get("previous_response_id")
        if previous is not None:
            found = earlier.history(previous)
            if found is None:
                if renders:
                    raise UnknownReply(
                        f"Previous response with id '{previous}' not found in trajectory "
                        f"{earlier.trajectory_id}: previous_response_id must name a response "
                        "answered in the same trajectory",
                        "previous_response_id",
                    )
                return
            messages, call = found
            history = messages[1:] if call.get("instructions") else messages
            request.messages = with_history(request, history)
        check_tool_results(request.messages)


DIALECT = ResponsesDialect()

"""Anthropic Messages: requests read into canonical messages, replies, streams and errors.

The canonical form is Chat Completions shaped. A request's top-level `system`
and any `role: "system"` entries become system messages; text blocks become the message's
content (one block is its string); `tool_use` blocks become `tool_calls` with their
`toolu_…` ids and the input as compact JSON arguments; `tool_result` blocks become
`role: "tool"` messages (`is_error` kept when true); `thinking` blocks become
`reasoning_content` plus `thinking_blocks` (with their signatures), `redacted_thinking`
is kept in `thinking_blocks`; images become `image_url` parts. `cache_control` is dropped.
Blocks of other types (server tools' `server_tool_use` and `web_search_tool_result`,
documents, …) and messages of other roles are kept as sent, as opaque parts
(`skycap.dialects.opaque`), which token mode refuses. The same reading applies to a reply
skycap answered and to the history a client re-sends, so a replayed conversation lands on
the nodes it came from.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Sequence
from typing import Any

import orjson

from skycap.dialects import (
    COUNT_TOKENS,
    Earlier,
    ReplyData,
    Request,
    Route,
    StreamWriter,
    canonical,
    tool_choice,
)
from skycap.dialects.messages_reply import (
    anthropic_error,
    arguments_json,
    block_frames,
    content_blocks,
    frame,
    message_object,
    models_listing,
    reply_stop,
    stop_reason,
)
from skycap.dialects.messages_stream import MessagesAssembler
from skycap.dialects.messages_writer import MessagesWriter
from skycap.dialects.opaque import opaque, opaque_message, refusal
from skycap.hashing import token_digest
from skycap.wire import BodyError, all_objects, json_type

#: Sampling keys this API has, under the chat names the graph records (format.md §3).
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k")
#: Anthropic stop reasons as the canonical (chat) finish reasons a call records.
_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}
SIGNATURE_PREFIX = "skycap-"
BILLING_PREFIX = "x-anthropic-billing-header:"
MAX_TOKENS_REQUIRED = "`max_tokens` is required: the Messages API needs it, and token mode uses it"
IMAGES_REFUSED = (
    "images are not supported in token mode yet (in a message or a tool result); send "
    "text, or capture this harness in text mode (--mode text)"
)
#: The block types read into canonical form, by the role whose content holds them.
READ_BLOCKS = {
    "system": ("text", "image"),
    "user": ("text", "image", "tool_result"),
    "assistant": ("text", "thinking", "redacted_thinking", "tool_use"),
    "tool_result": ("text", "image"),
}
ROLES = ("user", "assistant", "system")
PREFILL_REFUSED = (
    "a final assistant message (prefill) is not supported in token mode; end the "
    "conversation with a user message"
)


def _where(i: int, j: int | None = None) -> str:
    return f"messages[{i}].content" + ("" if j is None else f"[{j}]")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A content field as a list of blocks (a string is one text block); checks their shape."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BodyError(f"`{where}` must be a string or a list of blocks, got {json_type(content)}")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BodyError(f"`{where}[{j}]` must be an object with a string `type`")
    return content


def _text(block: dict[str, Any], where: str) -> dict[str, Any]:
    text = block.get("text")
    if not isinstance(text, str):
        raise BodyError(f"`{where}.text` must be a string, got {json_type(text)}")
    return {"type": "text", "text": text}


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif isinstance(source, dict) and source.get("type") == "url":
        url = source.get("url")
    else:
        raise BodyError(f"`{where}.source` must be a base64 or url image source")
    return {"type": "image_url", "image_url": {"url": url}}


def _unmarked(value: dict[str, Any]) -> dict[str, Any]:
    """A block or tool without its `cache_control` marker (it moves every turn)."""
    return {k: v for k, v in value.items() if k not in canonical.PART_DROPPED}


def _other(block: dict[str, Any]) -> dict[str, Any]:
    """A block this mapping does not read: an opaque part holding it as sent, without its
    `cache_control` marker."""
    return opaque("messages", _unmarked(block))


def _user_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    kind = block["type"]
    if kind == "text":
        return _text(block, where)
    if kind == "image":
        return _image(block, where)
    return _other(block)


def _tool_result(block: dict[str, Any], where: str, known: set[str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise BodyError(f"`{where}.tool_use_id` must be a non-empty string")
    if call_id not in known:
        raise BodyError(
            f"`{where}` is a tool_result for tool_use_id {call_id!r}, which no earlier "
            "assistant message's tool_use has; send the assistant turn that made the call"
        )
    content = block.get("content")
    if content is None:
        parts: Any = ""
    else:
        blocks = _blocks(content, f"{where}.content")
        parts = [_user_part(b, f"{where}.content[{k}]") for k, b in enumerate(blocks)]
    message: dict[str, Any] = {
        "role": "tool",
        "tool_call_id": call_id,
        "content": canonical.content(parts),
    }
    if block.get("is_error") is True:
        message["is_error"] = True
    return message


def _user(message: dict[str, Any], i: int, known: set[str]) -> list[dict[str, Any]]:
    """One user turn: its tool results as tool messages, its other blocks as user messages."""
    content = message.get("content")
    if type(content) is str:  # one text block, which reads as its string
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(content, _where(i))):
        if block["type"] == "tool_result":
            if parts:
                out.append({"role": "user", "content": canonical.content(parts)})
                parts = []
            out.append(_tool_result(block, _where(i, j), known))
        else:
            parts.append(_user_part(block, _where(i, j)))
    if parts or not out:
        out.append({"role": "user", "content": canonical.content(parts)})
    return out


def assistant_message(blocks: list[dict[str, Any]], where: str = "content") -> dict[str, Any]:
    """The canonical assistant message of an Anthropic content list.

    Used for a request's assistant turns, a non-streamed reply and an assembled stream alike,
    so the three agree.
    """
    parts: list[dict[str, Any]] = []
    thinking: list[str] = []
    thinking_blocks: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        at = f"{where}[{j}]"
        if kind == "text":
            parts.append(_text(block, at))
        elif kind == "thinking":
            text = block.get("thinking")
            if not isinstance(text, str):
                raise BodyError(f"`{at}.thinking` must be a string, got {json_type(text)}")
            thinking.append(text)
            entry = {"type": "thinking", "thinking": text}
            if block.get("signature") is not None:
                entry["signature"] = block["signature"]
            thinking_blocks.append(entry)
        elif kind == "redacted_thinking":
            thinking_blocks.append({"type": "redacted_thinking", "data": block.get("data")})
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
                raise BodyError(f"`{at}` (tool_use) needs a string `id` and `name`")
            function = {"name": name, "arguments": arguments_json(block.get("input", {}))}
            calls.append({"id": call_id, "type": "function", "function": function})
        else:
            parts.append(_other(block))
    message: dict[str, Any] = {"role": "assistant", "content": canonical.content(parts) or None}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if thinking_blocks:
        message["thinking_blocks"] = thinking_blocks
    if calls:
        message["tool_calls"] = calls
    return message


def _billing(block: dict[str, Any]) -> bool:
    """Claude Code's per-call `x-anthropic-billing-header: …` system block, which the API
    reads as metadata: its `cch=` value changes on every call, so it is dropped."""
    text = block.get("text")
    return block["type"] == "text" and isinstance(text, str) and text.startswith(BILLING_PREFIX)


def _system(content: Any, where: str) -> dict[str, Any] | None:
    """A system message, or None when it held only the billing block."""
    if type(content) is str and not content.startswith(BILLING_PREFIX):
        return {"role": "system", "content": content}  # one text block, read as its string
    blocks = _blocks(content, where)
    parts = [_user_part(b, f"{where}[{j}]") for j, b in enumerate(blocks) if not _billing(b)]
    if not parts and blocks:
        return None
    return {"role": "system", "content": canonical.content(parts)}


def _tools(tools: Any) -> tuple[list[Any] | None, str | None]:
    """(canonical tools, token-mode refusal): custom tools become chat function tools."""
    if tools is None:
        return None, None
    if not isinstance(tools, list) or not all_objects(tools):
        raise BodyError("`tools` must be a list of objects")
    out: list[Any] = []
    refusal = None
    for k, tool in enumerate(tools):
        if "input_schema" in tool:
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise BodyError(f"`tools[{k}].name` must be a non-empty string")
            function: dict[str, Any] = {"name": name, "parameters": tool["input_schema"]}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
        else:
            out.append(_unmarked(tool))
            refusal = refusal or (
                f"`tools[{k}]` is a server tool ({tool.get('type')!r}); token mode runs "
                "only tools with an input_schema"
            )
    return (out or None), refusal


def _has_image(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
        for m in messages
    )


def read_request(body: Any) -> Request:
    """Check a Messages request and read it into canonical form (module docstring)."""
    if not isinstance(body, dict):
        raise BodyError(f"request body must be a JSON object, got {json_type(body)}")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not all_objects(raw_messages):
        raise BodyError("`messages` must be a list of objects")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise BodyError(f"`max_tokens` must be a positive integer, got {max_tokens!r}")
    messages: list[dict[str, Any]] = []
    if body.get("system") not in (None, "", []):
        system = _system(body["system"], "system")
        if system is not None:
            messages.append(system)
    known: set[str] = set()
    for i, message in enumerate(raw_messages):
        role = message.get("role")
        if role == "user":
            messages.extend(_user(message, i, known))
        elif role == "assistant":
            content = message.get("content")
            if type(content) is str:  # one text block, as assistant_message reads it
                messages.append({"role": "assistant", "content": content or None})
                continue
            reply = assistant_message(_blocks(content, _where(i)), _where(i))
            known.update(call["id"] for call in reply.get("tool_calls", ()))
            messages.append(reply)
        elif role == "system":
            system = _system(message.get("content"), _where(i))
            if system is not None:
                messages.append(system)
        elif isinstance(role, str):
            messages.append(opaque_message("messages", _unmarked(message), role))
        else:
            raise BodyError(f"`messages[{i}].role` must be a string, got {json_type(role)}")
    tools, tool_refusal = _tools(body.get("tools"))
    sampling = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    stop = _stop_sequences(body.get("stop_sequences"))
    if stop:
        sampling["stop"] = stop  # token mode applies it as a stop string
    request = Request(
        body=body,
        messages=messages,
        tools=tools,
        model=body.get("model"),
        sampling=sampling,
        stream=body.get("stream") is True,
        refusal=lambda: _token_refusal(body, messages, tool_refusal),
    )
    return tool_choice.apply(request, *tool_choice.messages(body))


def _stop_sequences(value: Any) -> list[str] | None:
    """`stop_sequences` checked: a list of non-empty strings (None when absent)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise BodyError(f"`stop_sequences` must be a list of strings, got {json_type(value)}")
    for k, stop in enumerate(value):
        if not isinstance(stop, str) or not stop:
            raise BodyError(f"`stop_sequences[{k}]` must be a non-empty string, got {stop!r}")
    return value


def _token_refusal(
    body: dict[str, Any], messages: list[dict[str, Any]], tool_refusal: str | None
) -> str | None:
    """Why token mode cannot run this request, or None (checked in this order)."""
    if body.get("max_tokens") is None:
        return MAX_TOKENS_REQUIRED
    unread = _first_unread(body)
    if unread is not None:
        return refusal(unread[1], unread[0])
    if _has_image(messages):
        return IMAGES_REFUSED
    if tool_refusal is not None:
        return tool_refusal
    if messages and messages[-1]["role"] == "assistant":
        return PREFILL_REFUSED
    return None


def _first_unread(body: dict[str, Any]) -> tuple[str, Any] | None:
    """(JSON path, value) of the request's first block or message that reading kept opaque."""
    system = body.get("system")
    found = _unread_blocks(system, "system", "system") if isinstance(system, list) else None
    for i, message in enumerate(body["messages"]):
        if found is not None:
            break
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{i}]", {"type": f"{role} message"}
        found = _unread_blocks(message.get("content"), role, _where(i))
    return found


def _unread_blocks(blocks: Any, holder: str, where: str) -> tuple[str, Any] | None:
    for j, block in enumerate(blocks if isinstance(blocks, list) else ()):
        at = f"{where}[{j}]"
        if block["type"] not in READ_BLOCKS[holder]:
            return at, block
        if block["type"] == "tool_result":
            inner = _unread_blocks(block.get("content"), "tool_result", f"{at}.content")
            if inner is not None:
                return inner
    return None


def finish_reason_of(stop: Any) -> Any:
    """The canonical finish reason a call records for an Anthropic `stop_reason`."""
    return _FINISH_REASONS.get(stop, stop) if isinstance(stop, str) else None


def _id(prefix: str, completion_ids: Sequence[int], index: int) -> str:
    digest = hashlib.sha256(orjson.dumps(list(completion_ids))).hexdigest()
    return f"{prefix}{digest[:24]}_{index}"


def _issued_call(call: dict[str, Any], completion_ids: Sequence[int], k: int) -> dict[str, Any]:
    """A parsed call with a `toolu_…` id and the arguments spelled as a replay reads them."""
    function = dict(call["function"])
    try:
        function["arguments"] = arguments_json(json.loads(function["arguments"]))
    except (TypeError, ValueError):
        pass  # not JSON: answered wrapped (content_blocks), stored as the renderer parsed it
    return {**call, "id": _id("toolu_", completion_ids, k), "function": function}


def _streamed_reply(blocks: list[dict[str, Any]], stop: str) -> tuple[dict[str, Any], str]:
    return assistant_message(blocks), finish_reason_of(stop)


class MessagesDialect:
    """Anthropic Messages as a `Dialect` (see skycap.dialects)."""

    name = "messages"
    upstream_path = b"/messages"
    weight_versions_request = None  # vLLM's Messages route has no such request field
    reply_id_key = None
    routes = (
        Route("messages", "POST", "messages", "/v1/messages"),
        Route(
            "count-tokens",
            "POST",
            "messages/count_tokens",
            "/v1/messages/count_tokens",
            COUNT_TOKENS,
        ),
    )
    caller_header = "anthropic-version"  # every Anthropic SDK sends it
    api_host = "api.anthropic.com"
    forced_tool_finish = "tool_calls"

    def read(self, body: Any) -> Request:
        return read_request(body)

    def reply_message(self, parsed: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
        """(canonical message, finish reason, usage) of a non-streamed `message` body."""
        content = parsed.get("content")
        if parsed.get("type") != "message" or not isinstance(content, list):
            raise ValueError(f"not a Messages reply: {orjson.dumps(parsed)[:200]!r}")
        try:
            message = assistant_message(_blocks(content, "content"))
        except BodyError as exc:
            raise ValueError(str(exc)) from None
        return message, finish_reason_of(parsed.get("stop_reason")), parsed.get("usage")

    def assembler(self) -> MessagesAssembler:
        return MessagesAssembler(_streamed_reply)

    def issue(
        self,
        message: dict[str, Any],
        completion_ids: Sequence[int],
        reasoning_ids: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """`toolu_…` ids, a thinking block with skycap's signature, no empty text.

        The signature names the exact tokens the thinking was sampled in (`reasoning_ids`,
        through its end, or the whole completion), so a replayed thinking block says
        which sampled reply it came from, and a stream can send it when the thinking ends.
        """
        out = {k: v for k, v in message.items() if k not in ("tool_calls", "reasoning_content")}
        if out.get("content") == "":
            out["content"] = None
        reasoning = message.get("reasoning_content")
        if reasoning:
            out["reasoning_content"] = reasoning
            signing = completion_ids if reasoning_ids is None else reasoning_ids
            signature = SIGNATURE_PREFIX + token_digest(signing)
            block = {"type": "thinking", "thinking": reasoning, "signature": signature}
            out["thinking_blocks"] = [block]
        calls = message.get("tool_calls")
        if calls:
            out["tool_calls"] = [
                _issued_call(call, completion_ids, k) for k, call in enumerate(calls)
            ]
        return out

    def reply_id(self) -> str:
        return "msg_" + secrets.token_hex(12)

    def reply_json(self, reply: ReplyData) -> bytes:
        blocks = content_blocks(reply.message)
        message = message_object(reply, blocks, reply_stop(reply), reply.stop_sequence)
        return orjson.dumps(message)

    def reply_sse(self, reply: ReplyData) -> bytes:
        """message_start, each block's start/delta/stop, message_delta, message_stop."""
        start = message_object(reply, [], None, None)
        start["usage"]["output_tokens"] = 0
        frames = [frame("message_start", {"message": start})]
        for index, block in enumerate(content_blocks(reply.message)):
            frames.extend(block_frames(index, block))
        delta = {"stop_reason": reply_stop(reply), "stop_sequence": reply.stop_sequence}
        usage = {"output_tokens": reply.completion_tokens}
        frames.append(frame("message_delta", {"delta": delta, "usage": usage}))
        frames.append(frame("message_stop", {}))
        return b"".join(frames)

    def error(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> bytes:
        """Anthropic's error shape has no field name: `param` is not sent."""
        return anthropic_error(status, message, code)

    def finish_reason(self, canonical_reason: str) -> str:
        return stop_reason(canonical_reason)

    def stream_failure(self, assembler: MessagesAssembler, message: str) -> bytes:
        """An `error` event (`api_error`) ends a relayed stream that broke."""
        return assembler.cut() + b"event: error\ndata: " + anthropic_error(502, message) + b"\n\n"

    def stream_writer(self, head: ReplyData, reasoning_keys: Sequence[str]) -> StreamWriter:
        return MessagesWriter(head)

    def models_listing(self, status: int, body: bytes) -> bytes:
        return models_listing(status, body)

    def prepare(self, request: Request, earlier: Earlier, renders: bool) -> None:
        """A call stands on its own messages: nothing to prepare."""


DIALECT = MessagesDialect()

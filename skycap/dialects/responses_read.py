"""The OpenAI Responses API read into canonical chat messages and tools.

A Responses request carries `instructions` and an `input` that is a string or a list of
items. Reading turns them into the Chat Completions shaped messages every node stores:
`message` items become messages of their role, a run of assistant-side items
(`reasoning`, assistant `message`, `function_call`) becomes one assistant message with
`reasoning_content`, `reasoning_items`, `content` and `tool_calls`, and each
`function_call_output` becomes a `role: "tool"` message. Item ids, statuses, annotations
and other keys that change no token are dropped, so a replayed history hashes the same as
the reply it came from. The writer (`responses_reply`) produces the inverse, so token
mode's answers read back to the exact message it stored.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import orjson

from skycap.dialects import Request, tool_choice
from skycap.dialects.opaque import kind_of, opaque, opaque_message, refusal
from skycap.dialects.responses_tools import (
    RequestError,
    Tools,
    custom_arguments,
    qualified,
    read_tools,
)
from skycap.wire import json_type

#: The dialect's name, on the opaque parts it keeps.
DIALECT_NAME = "responses"

#: The item types this dialect reads into canonical messages; others are kept as sent.
ITEM_TYPES = (
    "message",
    "reasoning",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
)
#: Items that declare tools inside the input (read into the request's tools, no message).
ADDITIONAL_TOOLS = "additional_tools"
#: Items that answer a call (a harness's tool result): their own message, never part of
#: the assistant turn before them.
RESULT_TYPES = ("function_call_output", "custom_tool_call_output")
ROLES = ("user", "system", "developer", "assistant")
#: Codex's remote compaction items (a request for one, and the opaque result it replays).
COMPACTION_TYPES = ("compaction_trigger", "compaction")
#: Token mode's `encrypted_content`: this prefix, then base64url of a small JSON object
#: holding the reasoning text and the digest of the completion it came from.
REASONING_TOKEN_PREFIX = "skycap.r1."
#: Request keys that ask for server-side features skycap does not provide: a background
#: response has no reply to record, so it is refused in both modes.
UNSUPPORTED_KEYS = {
    "background": "background responses are not supported: call without `background`",
}
#: Keys whose content the upstream holds: text mode forwards them and records what was
#: sent; token mode, which has no such content to render, refuses them.
SERVER_SIDE_KEYS = {
    "conversation": "conversations are not supported in token mode: send the history in "
    "`input` (or use previous_response_id)",
    "prompt": "prompt templates are not supported in token mode: send `instructions` and `input`",
}
#: Request keys read as sampling, with the chat name they are recorded under (format.md §4).
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_output_tokens": "max_tokens",
}
#: Fields that change no token but say something about the call: recorded under
#: `token_neutral` by their dotted paths, never hashed (docs/format.md §9).
TOKEN_NEUTRAL = ("client_metadata", "prompt_cache_key", "text.verbosity", "reasoning.context")
_NEUTRAL_KEYS = tuple((path, path.split(".")) for path in TOKEN_NEUTRAL)
_NEUTRAL_TOPS = frozenset(keys[0] for _, keys in _NEUTRAL_KEYS)
#: The content part types read as text.
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_PLAIN_PARTS = ("input_text", "output_text", "text")  # their text is under `text`


def read_request(body: Any) -> Request:
    """Check a `POST /v1/responses` body and read it (RequestError when refused).

    `messages` are the instructions (a leading system message) and the input; with
    `previous_response_id` the server puts the named response's history between them
    (`with_history`). Tools are the top-level ones, then those of `additional_tools`
    items in input order (`responses_tools`); `extras["token_tools"]` and
    `extras["omitted_tools"]` say what token mode renders. Items, parts and tools skycap
    does not read are kept as sent (opaque parts) and make token mode refuse the call.
    """
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {json_type(body)}")
    for key, why in UNSUPPORTED_KEYS.items():
        if body.get(key) not in (None, False):
            raise RequestError(why, key)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError(
            f"`instructions` must be a string, got {json_type(instructions)}", "instructions"
        )
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise RequestError(
            f"`previous_response_id` must be a response id string, got {previous!r:.80}",
            "previous_response_id",
        )
    for flag in ("stream", "store"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise RequestError(f"`{flag}` must be a boolean, got {body[flag]!r:.80}", flag)
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise RequestError("`include` must be a list of strings", "include")
    tools = Tools()
    if body.get("tools") is not None:
        read_tools(body["tools"], "tools", tools)
    unread: list[tuple[str, Any]] = []
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += read_input(body.get("input"), tools, unread)
    extras: dict[str, Any] = {"instructions": bool(instructions), "tools": tools}
    recorded: dict[str, Any] = {}
    if previous is not None:
        extras["previous_response_id"] = recorded["previous_response_id"] = previous
    if instructions:
        recorded["instructions"] = True
    if neutral := token_neutral(body):
        recorded["token_neutral"] = neutral
    if not tools.plain:
        extras["token_tools"] = tools.rendered or None
    if tools.omitted:
        extras["omitted_tools"] = tools.omitted
    request = Request(
        body=body,
        messages=messages,
        tools=tools.canonical or None,
        model=body.get("model"),
        sampling=read_sampling(body),
        stream=body.get("stream") is True,
        extras=extras,
        refusal=lambda: token_refusal(body, messages, unread),
        recorded=recorded,
    )
    return tool_choice.apply(request, *tool_choice.responses(body))


def with_history(request: Request, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages with `history` (a stored response's path, its own
    instructions left out: they do not carry over) between instructions and input."""
    head = 1 if request.extras.get("instructions") else 0
    return request.messages[:head] + history + request.messages[head:]


def read_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request's sampling as sent, under the chat names the call records (format.md §4)."""
    return {chat: body[key] for key, chat in SAMPLING_FIELDS.items() if body.get(key) is not None}


def token_neutral(body: Mapping[str, Any]) -> dict[str, Any]:
    """The token-neutral fields the request set, by dotted path."""
    found: dict[str, Any] = {}
    if _NEUTRAL_TOPS.isdisjoint(body):  # the usual request: none set
        return found
    for path, keys in _NEUTRAL_KEYS:
        value: Any = body
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            found[path] = value
    return found


def token_refusal(
    body: Mapping[str, Any], messages: list[dict[str, Any]], unread: list[tuple[str, Any]]
) -> str | None:
    """Why token mode cannot run this request (text mode forwards it all the same), or None."""
    for key, why in SERVER_SIDE_KEYS.items():
        if body.get(key) not in (None, False):
            return why
    for path, value in unread:
        if kind_of(value) in COMPACTION_TYPES:
            return (
                f"{path} is a {kind_of(value)} item: remote compaction (Codex's default OpenAI "
                "provider) cannot be rendered, its result being an opaque item no one could "
                "train on; give Codex a model provider whose base_url is the trajectory's (it "
                "then compacts with ordinary calls), or raise model_auto_compact_token_limit"
            )
        return refusal(value, path)
    if any(
        isinstance(part, dict) and part.get("type") == "image_url"
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    ):
        return (
            "an input_image was sent; token mode renders text only: send text, or capture "
            "this harness in text mode"
        )
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        kind = text["format"].get("type")
        if kind not in (None, "text"):
            return (
                f"text.format type {kind!r} is not supported in token mode (skycap samples "
                "unconstrained text): drop `text.format`, or capture this harness in text mode"
            )
    if body.get("top_logprobs"):
        return (
            "`top_logprobs` is not supported in token mode: the record holds each sampled "
            "token's logprob; drop `top_logprobs`"
        )
    return None


def read_input(value: Any, tools: Tools, unread: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """The `input` (a string or a list of items) as canonical messages; the tools its
    `additional_tools` items declare join `tools`, what it holds unread joins `unread`."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise RequestError(
            f"`input` must be a string or a list of items, got {json_type(value)}", "input"
        )
    return read_items(value, unread, tools=tools)


def read_items(
    items: list[Any],
    unread: list[tuple[str, Any]] | None = None,
    where: str = "input",
    tools: Tools | None = None,
) -> list[dict[str, Any]]:
    """Input or output items as canonical messages (an assistant run becomes one message).

    An item of a type skycap does not read is kept as sent: inside the assistant run when
    it has no role (a hosted tool call such as `web_search_call`), as a message of its
    own when it has a role or answers a call the harness ran (`…_output`); its path and
    value join `unread`. The tools of `additional_tools` items join `tools` (an input's).
    """
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message the current run builds
    for index, item in enumerate(items):
        if type(item) is dict:
            # The usual item, a message of plain text, in a few steps: what the rules
            # below make of it.
            kind, role = item.get("type"), item.get("role")
            if (kind == "message" or (kind is None and role is not None)) and role in ROLES:
                text = _plain(item.get("content"))
                if text is not None:
                    if role != "assistant":
                        turn = None
                        messages.append({"role": role, "content": text})
                    elif turn is None:
                        turn = {"role": "assistant", "content": text}
                        messages.append(turn)
                    else:
                        turn["content"] = _joined(turn["content"], text)
                    continue
        at = f"{where}[{index}]"
        if not isinstance(item, dict):
            raise RequestError(f"{at} must be an object, got {json_type(item)}", at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == ADDITIONAL_TOOLS:
            if tools is not None:
                read_tools(item.get("tools"), f"{at}.tools", tools)
            turn = None
            continue
        role = item.get("role")
        if role is not None and not isinstance(role, str):
            raise RequestError(f"{at}.role must be a string, got {json_type(role)}", f"{at}.role")
        if kind == "message" and role is None:
            raise RequestError(
                f"{at} is a message without a `role`; use one of {', '.join(ROLES)}",
                f"{at}.role",
            )
        if kind not in ITEM_TYPES or (kind == "message" and role not in ROLES):
            if unread is not None:
                unread.append((at, item))
            if _in_turn(kind, item):
                if turn is None:
                    turn = {"role": "assistant", "content": None}
                    messages.append(turn)
                turn["content"] = _joined(turn["content"], [opaque(DIALECT_NAME, item)])
            else:
                turn = None
                messages.append(opaque_message(DIALECT_NAME, item, role))
        elif kind == "message" and role != "assistant":
            turn = None
            messages.append(_message(item, at, unread))
        elif kind in RESULT_TYPES:
            turn = None
            messages.append(_tool_result(item, at, unread))
        else:
            if turn is None:
                turn = {"role": "assistant", "content": None}
                messages.append(turn)
            _fold(turn, kind, item, at, unread)
    return messages


def _in_turn(kind: Any, item: dict[str, Any]) -> bool:
    """Whether an unread item belongs to the assistant turn around it: a roleless item
    that is not a harness's answer to a call (a server-run tool's output is the model's)."""
    if item.get("role") not in (None, "assistant"):
        return False
    if isinstance(kind, str) and kind.endswith("_output"):
        return item.get("execution") == "server"
    return kind not in COMPACTION_TYPES


def _message(
    item: dict[str, Any], where: str, unread: list[tuple[str, Any]] | None
) -> dict[str, Any]:
    return {
        "role": item["role"],
        "content": _content(item.get("content"), f"{where}.content", unread),
    }


def _plain(value: Any) -> str | None:
    """The text of a content that is a string or one text part (as `_content` reads it),
    else None."""
    if type(value) is str:
        return value
    if type(value) is list and len(value) == 1:
        part = value[0]
        if type(part) is dict and part.get("type") in _PLAIN_PARTS:
            text = part.get("text")
            if type(text) is str:
                return text
    return None


def _content(value: Any, where: str, unread: list[tuple[str, Any]] | None) -> Any:
    """A string stays a string; parts become text (one text part is the plain string)."""
    if (text := _plain(value)) is not None:
        return text
    if not isinstance(value, list):
        raise RequestError(f"{where} must be a string or a list of parts", where)
    parts = [_part(part, f"{where}[{i}]", unread) for i, part in enumerate(value)]
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _part(part: Any, where: str, unread: list[tuple[str, Any]] | None) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise RequestError(f"{where} ({kind}) has no string text", where)
        return {"type": "text", "text": text}
    url = part.get("image_url") if kind == "input_image" else None
    if isinstance(url, str) and url:
        image: dict[str, Any] = {"url": url}
        if part.get("detail") is not None:
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if unread is not None:
        unread.append((where, part))
    return opaque(DIALECT_NAME, part)


def _tool_result(
    item: dict[str, Any], where: str, unread: list[tuple[str, Any]] | None
) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{where} is a {item['type']} without a `call_id`", where)
    output = item.get("output")
    content = output if isinstance(output, str) else _content(output, f"{where}.output", unread)
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _fold(
    turn: dict[str, Any],
    kind: str,
    item: dict[str, Any],
    where: str,
    unread: list[tuple[str, Any]] | None,
) -> None:
    """Add one assistant-side item to the run's message."""
    if kind == "message":
        content = _content(item.get("content"), f"{where}.content", unread)
        turn["content"] = _joined(turn["content"], content)
    elif kind in ("function_call", "custom_tool_call"):
        turn.setdefault("tool_calls", []).append(_call(kind, item, where))
    else:
        text = reasoning_text(item, where)
        if text is not None:
            turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        kept = {k: item[k] for k in ("id", "summary", "encrypted_content") if item.get(k)}
        turn.setdefault("reasoning_items", []).append(kept)


def _call(kind: str, item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function or custom tool call as a canonical function call, by the name the model
    called (a namespace member's qualified name); a custom call's input is its one
    argument, `{"input": …}` as compact JSON (docs/format.md §9)."""
    value = "arguments" if kind == "function_call" else "input"
    for key in ("call_id", "name", value):
        if not isinstance(item.get(key), str) or (key != value and not item[key]):
            raise RequestError(f"{where} is a {kind} without a string `{key}`", where)
    namespace = item.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise RequestError(f"{where}.namespace must be a string", f"{where}.namespace")
    name = qualified(namespace, item["name"])
    arguments = item["arguments"] if kind == "function_call" else custom_arguments(item["input"])
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def reasoning_text(item: dict[str, Any], where: str) -> str | None:
    """The reasoning a `reasoning` item stands for: skycap's own token names it exactly;
    otherwise its `content` texts. A summary is not the reasoning: it stays in
    `reasoning_items` only."""
    token = item.get("encrypted_content")
    if isinstance(token, str) and token.startswith(REASONING_TOKEN_PREFIX):
        return decode_reasoning_token(token, where)[1]
    return _texts(item.get("content"))


def _texts(parts: Any) -> str | None:
    if not isinstance(parts, list) or not parts:
        return None
    return "".join(
        p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
    )


def _joined(before: Any, content: Any) -> Any:
    """Two message items of one assistant run: their texts in order (the text-part rules of
    format.md §9)."""
    if before is None:
        return content
    parts = [p for c in (before, content) for p in (c if isinstance(c, list) else [_text(c)])]
    return parts


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def reasoning_token(completion_digest: str, text: str) -> str:
    """Token mode's opaque `encrypted_content`: the reasoning `text` and the digest of the
    completion's tokens it was sampled in (so it names the exact model node)."""
    payload = orjson.dumps({"t": completion_digest, "r": text})
    return REASONING_TOKEN_PREFIX + base64.urlsafe_b64encode(payload).decode("ascii")


def decode_reasoning_token(token: str, where: str = "encrypted_content") -> tuple[str, str]:
    """(completion digest, reasoning text) of a `reasoning_token`; RequestError if damaged."""
    try:
        data = orjson.loads(base64.urlsafe_b64decode(token[len(REASONING_TOKEN_PREFIX) :]))
        digest, text = data["t"], data["r"]
        if not isinstance(digest, str) or not isinstance(text, str):
            raise ValueError("wrong types")
    except (binascii.Error, ValueError, KeyError, TypeError) as exc:
        raise RequestError(
            f"{where}: an encrypted_content skycap issued was altered ({exc}); send reasoning "
            "items back exactly as they were received",
            where,
        ) from None
    return digest, text


def check_tool_results(messages: list[dict[str, Any]]) -> None:
    """Every tool result answers a function_call earlier in the history (RequestError if not)."""
    called: set[str] = set()
    for message in messages:
        for call in message.get("tool_calls") or ():
            called.add(call.get("id"))
        if message.get("role") == "tool" and message.get("tool_call_id") not in called:
            call_id = message.get("tool_call_id")
            raise RequestError(
                f"function_call_output has call_id {call_id!r}, which matches no function_call "
                "in the history; send the function_call item (or previous_response_id) with it",
                "input",
            )

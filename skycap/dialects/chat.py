"""OpenAI Chat Completions, the first dialect: its requests, replies, streams and errors.

The canonical form is this API's own message shape, so reading a request only
checks it (http.md §3 step 4) and folds the token-neutral spellings (format.md §9); a
content part of a type skycap does not read (`input_audio`, `file`, …) is kept as sent,
as an opaque part (`skycap.dialects.opaque`), which token mode refuses.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from skycap.dialects import Earlier, ReplyData, Request, Route, StreamWriter, canonical, tool_choice
from skycap.dialects.chat_writer import (
    ChatWriter,
    include_usage,
    openai_error,
    reply_head,
    usage_of,
)
from skycap.dialects.opaque import opaque, refusal
from skycap.dialects.sse import EVENTS_BEFORE_SHAPES, EventStream, StreamError, Where
from skycap.wire import BodyError, all_objects, json_type

#: A chat request's sampling keys: text mode records them as the call's `sampling`
#: (format.md §4); token mode merges them with `--sampling-overrides` (http.md §3.2).
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)

#: `--reasoning-field` choices: the keys a token-mode reply carries the reasoning text under.
REASONING_FIELDS = ("both", "reasoning_content", "reasoning")

#: The content part types skycap reads (renders); others are kept as opaque parts.
READ_PARTS = ("text", "image_url", "refusal")

#: A message of only these keys with a string content is canonical as it is: nothing in
#: it is folded or dropped (canonical.chat_message), so it is read as a copy.
_PLAIN_KEYS = frozenset(("role", "content", "name", "tool_call_id"))

MESSAGES_MESSAGE = "`messages` must be a list of objects"
N_MESSAGE = "`n` > 1 is not supported: one call produces one sample"


def check_chat_request(body: Any) -> dict[str, Any]:
    """Apply the harness step-4 checks of http.md §3 in order; return the body as a dict.

    `n` must be exactly the integer 1 when present: an explicit null, `true` or `1.0`
    is refused too, since any other value could ask the server for several samples.
    """
    if not isinstance(body, dict):
        raise BodyError(f"request body must be a JSON object, got {json_type(body)}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all_objects(messages):
        raise BodyError(MESSAGES_MESSAGE)
    if "n" in body:
        n = body["n"]
        if type(n) is not int or n != 1:
            raise BodyError(N_MESSAGE)
    return body


def read_message(
    message: dict[str, Any], where: str, unread: list[tuple[str, Any]]
) -> dict[str, Any]:
    """A message in canonical form; its unread parts become opaque parts, their JSON
    paths and values joining `unread`."""
    out = canonical.chat_message(message)
    content = out.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in READ_PARTS:
                parts.append(part)
            else:
                unread.append((f"{where}.content[{j}]", part))
                parts.append(opaque("chat", part))
        out["content"] = parts
    return out


def recorded_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request's sampling as sent: its present, non-null SAMPLING_KEYS, values untouched.

    Text mode records exactly this; token mode merges it with the overrides first.
    """
    return {key: body[key] for key in SAMPLING_KEYS if body.get(key) is not None}


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def _indexed[T](table: dict[int, T], item: dict[str, Any], make: Callable[[], T]) -> T:
    """The state an `index` field names, made on first sight; no integer index means 0."""
    index = item.get("index")
    if type(index) is not int:
        index = 0
    state = table.get(index)
    if state is None:
        state = table[index] = make()
    return state


class _ToolCall:
    __slots__ = ("id", "name", "arguments")

    def __init__(self) -> None:
        self.id: str | None = None
        self.name: list[str] = []
        self.arguments: list[str] = []

    def message(self) -> dict[str, Any]:
        call: dict[str, Any] = {} if self.id is None else {"id": self.id}
        call["type"] = "function"
        call["function"] = {"name": "".join(self.name), "arguments": "".join(self.arguments)}
        return call


class _Choice:
    __slots__ = ("role", "content", "reasoning", "tool_calls", "finish_reason")

    def __init__(self) -> None:
        self.role = "assistant"
        self.content: list[str] | None = None
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, _ToolCall] = {}
        self.finish_reason: str | None = None

    def apply(self, delta: dict[str, Any]) -> None:
        content = delta.get("content")
        if type(content) is str:
            if self.content is None:
                self.content = [content]
            else:
                self.content.append(content)
            if len(delta) == 1:  # the usual token: nothing else to read
                return
        role = delta.get("role")
        if isinstance(role, str) and role:
            self.role = role
        reasoning = delta.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = delta.get("reasoning")
        if isinstance(reasoning, str):
            self.add_reasoning(reasoning)
        tool_calls = delta.get("tool_calls")
        if isinstance(tool_calls, list):
            for entry in tool_calls:
                if isinstance(entry, dict):
                    self._merge_tool_call(entry)

    def add_reasoning(self, text: str) -> None:
        if text:  # an empty piece leaves a reply without reasoning as it is
            self.reasoning.append(text)

    def shape_of(self, delta: dict[str, Any]) -> tuple[Where, str, Callable[[str], None]] | None:
        """(where, the string, what adds it) for a delta that only adds one string to this
        choice (content, reasoning, a tool call's arguments); else None."""
        if len(delta) != 1:
            return None
        ((key, value),) = delta.items()
        if key == "content" and type(value) is str:
            return ("content",), value, self.content.append  # type: ignore[union-attr]
        if key in ("reasoning_content", "reasoning") and type(value) is str:
            return (key,), value, self.add_reasoning
        if key == "tool_calls" and type(value) is list and len(value) == 1:
            entry = value[0]
            if (
                type(entry) is dict
                and len(entry) == 2
                and type(entry.get("index")) is int
                and type(function := entry.get("function")) is dict
                and len(function) == 1
                and type(function.get("arguments")) is str
            ):
                arguments = self.tool_calls[entry["index"]].arguments
                where = ("tool_calls", 0, "function", "arguments")
                return where, function["arguments"], arguments.append
        return None

    def _merge_tool_call(self, entry: dict[str, Any]) -> None:
        call = _indexed(self.tool_calls, entry, _ToolCall)
        call_id = entry.get("id")
        if isinstance(call_id, str) and call_id:
            call.id = call_id
        function = entry.get("function")
        if isinstance(function, dict):
            name = function.get("name")
            if isinstance(name, str):
                call.name.append(name)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call.arguments.append(arguments)

    def message(self) -> dict[str, Any]:
        content = None if self.content is None else "".join(self.content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [
                self.tool_calls[index].message() for index in sorted(self.tool_calls)
            ]
        return message


class StreamAssembler(EventStream):
    """Feed a chat-completion SSE stream as it arrives; ask for the reply at the end (http.md §3.1).

    Relay use (http.md §3.1): after each `feed(chunk)`, hold `chunk` back if
    `finish_seen` is true. The flag only ever turns on, so the first held chunk is the
    one in which a `finish_reason` first appeared. A streamed `reasoning` delta is stored
    as `reasoning_content`.
    """

    __slots__ = ("_choices", "_usage", "_finish_seen", "_reported_error")

    def __init__(self) -> None:
        super().__init__()
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._finish_seen = False
        self._reported_error: Any = None

    @property
    def finish_seen(self) -> bool:
        """Whether any choice has carried a non-empty `finish_reason` so far."""
        return self._finish_seen

    @property
    def usage(self) -> dict[str, Any] | None:
        """The last top-level `usage` object seen, or None."""
        return self._usage

    def _event(self, name: bytes | None, event: dict[str, Any]) -> None:
        # One call per token of a reply: written for that, each read once.
        usage = event.get("usage")
        if type(usage) is dict:
            self._usage = usage
        if "error" in event:
            self._reported_error = event["error"]
        choices = event.get("choices")
        if choices is None:
            return
        if type(choices) is not list or not all_objects(choices):
            self._error = f"unreadable stream: `choices` is not a list of objects: {choices!r:.200}"
            return
        state = None
        for choice in choices:
            state = self._choice(choice)
        # The event's own spans, else its first choice's (vLLM puts them there,
        # chat_completion/serving.py): the order skycap.weights.reported_spans reads a
        # whole reply in.
        if event.get("weight_versions") is not None:
            self.note_spans(event)
        elif choices and choices[0].get("weight_versions") is not None:
            self.note_spans(choices[0])
        elif (
            self._events > EVENTS_BEFORE_SHAPES
            and state is not None
            and len(choices) == 1
            and type(usage) is not dict
            and "error" not in event
        ):
            self._learn(event, choices[0], state)

    def _learn(self, event: dict[str, Any], choice: dict[str, Any], state: _Choice) -> None:
        """Learn the shape of a token event: one choice whose delta only adds a string."""
        finish_reason = choice.get("finish_reason")
        delta = choice.get("delta")
        if (type(finish_reason) is str and finish_reason) or type(delta) is not dict:
            return
        found = state.shape_of(delta)
        if found is not None:
            where, text, apply = found
            self.learn_shape(event, ("choices", 0, "delta", *where), text, apply)

    def _choice(self, choice: dict[str, Any]) -> _Choice:
        """Apply one choice's part of an event to its state, which it returns."""
        state = _indexed(self._choices, choice, _Choice)
        finish_reason = choice.get("finish_reason")
        if type(finish_reason) is str and finish_reason:
            state.finish_reason = finish_reason
            self._finish_seen = True
        delta = choice.get("delta")
        if type(delta) is dict:
            state.apply(delta)
        return state

    def result(self) -> tuple[dict[str, Any], str]:
        """The first choice's assembled message and finish_reason (http.md §3.1).

        Raises StreamError when a payload was unreadable or the first choice never got a
        finish_reason (a cut-off or error stream must not be recorded as a reply).
        """
        if self._error is not None:
            raise StreamError(self._error)
        first = self._choices[min(self._choices)] if self._choices else None
        if first is None or first.finish_reason is None:
            raise StreamError(self._missing_finish())
        return first.message(), first.finish_reason

    def _missing_finish(self) -> str:
        ending = "[DONE] seen" if self._done else "no [DONE] before the end"
        message = f"unreadable stream: no finish_reason in {self._events} JSON events ({ending})"
        if self._reported_error is not None:
            message += f"; the stream reported an error: {self._reported_error!r:.300}"
        return message


def reply_message(parsed: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
    """(canonical message, finish_reason, usage) of a non-streamed `chat.completion` body.

    Raises ValueError naming what is missing when there is no first choice with a message.
    """
    choices = parsed.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError(f"no choices in the body: {orjson.dumps(parsed)[:200]!r}")
    choice = choices[0]
    if not isinstance(choice.get("message"), dict):
        raise ValueError("the first choice has no message object")
    return (
        read_message(choice["message"], "choices[0].message", []),
        choice.get("finish_reason"),
        parsed.get("usage"),
    )


#: Reasoning keys a reply may carry, in the order a stream sends them.
_REASONING_KEYS = ("reasoning_content", "reasoning")


class ChatDialect:
    """Chat Completions as a `Dialect` (see skycap.dialects)."""

    name = "chat"
    upstream_path = b"/chat/completions"
    #: vLLM's Chat Completions attach `weight_versions` only when asked
    #: (chat_completion/protocol.py, `return_weight_versions`, default false).
    weight_versions_request = b'"return_weight_versions":true'
    reply_id_key = None
    routes = (Route("chat", "POST", "chat/completions", "/chat/completions"),)
    caller_header = None
    api_host = None
    #: OpenAI and vLLM answer a call that forced a named tool with "stop", not "tool_calls".
    forced_tool_finish = "stop"

    def read(self, body: Any) -> Request:
        body = check_chat_request(body)
        tools = body.get("tools")
        extras = {k: body[k] for k in ("cache_salt", "max_prompt_tokens") if k in body}
        unread: list[tuple[str, Any]] = []
        messages = [
            dict(m)  # what read_message makes of it, in a few steps
            if type(m.get("content")) is str and _PLAIN_KEYS.issuperset(m)
            else read_message(m, f"messages[{i}]", unread)
            for i, m in enumerate(body["messages"])
        ]
        for k, tool in enumerate(tools if isinstance(tools, list) else ()):
            if isinstance(tool, dict) and tool.get("type") not in (None, "function"):
                unread.append((f"tools[{k}]", tool))  # a custom or hosted tool: not rendered
        request = Request(
            body=body,
            messages=messages,
            tools=tools if isinstance(tools, list) and tools else None,
            model=body.get("model"),
            sampling=recorded_sampling(body),
            stream=body.get("stream") is True,
            extras=extras,
            refusal=refusal(unread[0][1], unread[0][0]) if unread else None,
        )
        return tool_choice.apply(request, *tool_choice.chat(body))

    def reply_message(self, parsed: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
        return reply_message(parsed)

    def assembler(self) -> StreamAssembler:
        return StreamAssembler()

    def issue(
        self,
        message: dict[str, Any],
        completion_ids: Sequence[int],
        reasoning_ids: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """Chat replies carry the renderer's own `call_…` ids; nothing more to issue."""
        return message

    def reply_id(self) -> str:
        return completion_id()

    def reply_json(self, reply: ReplyData) -> bytes:
        """The non-streamed `chat.completion` body (http.md §3.2)."""
        choice = {
            "index": 0,
            "finish_reason": reply.finish_reason,
            "logprobs": None,
            "message": reply.message,
        }
        return orjson.dumps(
            {**reply_head(reply, "chat.completion"), "choices": [choice], "usage": usage_of(reply)}
        )

    def reply_sse(self, reply: ReplyData) -> bytes:
        """The whole synthesised stream as one buffered body (docs/tokens.md "Streaming").

        Usage comes as a last `choices: []` chunk, only when the request asked for it with
        `stream_options.include_usage` (as OpenAI and vLLM send it).
        """
        head = reply_head(reply, "chat.completion.chunk")

        def frame(delta: dict[str, Any], reason: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
            return b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"

        message = reply.message
        frames = [frame({"role": "assistant"})]
        reasoning = {k: message[k] for k in _REASONING_KEYS if message.get(k)}
        if reasoning:
            frames.append(frame(reasoning))
        if message.get("content"):
            frames.append(frame({"content": message["content"]}))
        for index, call in enumerate(message.get("tool_calls") or ()):
            frames.append(frame({"tool_calls": [{"index": index, **call}]}))
        frames.append(frame({}, reply.finish_reason))
        if reply.request is not None and include_usage(reply.request.body):
            usage = {**head, "choices": [], "usage": usage_of(reply)}
            frames.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        frames.append(b"data: [DONE]\n\n")
        return b"".join(frames)

    def error(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> bytes:
        return openai_error(status, message, code, param)

    def finish_reason(self, canonical_reason: str) -> str:
        return canonical_reason

    def stream_failure(self, assembler: StreamAssembler, message: str) -> bytes:
        """An `error` data event ends a relayed stream that broke (the SDK raises it)."""
        return assembler.cut() + b"data: " + openai_error(502, message) + b"\n\n"

    def stream_writer(self, head: ReplyData, reasoning_keys: Sequence[str]) -> StreamWriter:
        return ChatWriter(head, reasoning_keys)

    def models_listing(self, status: int, body: bytes) -> bytes:
        return body  # the engine's list is already in this API's shape

    def prepare(self, request: Request, earlier: Earlier, renders: bool) -> None:
        """A call stands on its own messages: nothing to prepare."""


DIALECT = ChatDialect()

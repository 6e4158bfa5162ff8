"""Incremental assembly of an OpenAI chat-completion SSE stream into one message (http.md §8)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

_PAYLOAD_PREVIEW = 200


class StreamError(ValueError):
    """The stream cannot be recorded; the message starts `unreadable stream: ` (format.md §5)."""


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
        role = delta.get("role")
        if isinstance(role, str) and role:
            self.role = role
        content = delta.get("content")
        if isinstance(content, str):
            if self.content is None:
                self.content = [content]
            else:
                self.content.append(content)
        reasoning = delta.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            self.reasoning.append(reasoning)
        tool_calls = delta.get("tool_calls")
        if isinstance(tool_calls, list):
            for entry in tool_calls:
                if isinstance(entry, dict):
                    self._merge_tool_call(entry)

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


class StreamAssembler:
    """Feed the raw response bytes as they arrive; ask for the assembled reply at the end.

    Work per `feed` is proportional to the chunk (only an unterminated line is carried
    over), so it can sit in the relay's hot path. `feed` never raises: a relay must keep
    passing bytes to the harness, so a bad payload is remembered and raised by `result()`.

    Relay use (http.md §7.3): after each `feed(chunk)`, hold `chunk` back if
    `finish_seen` is true. The flag only ever turns on, so the first held chunk is the
    one in which a `finish_reason` first appeared.

    An event is dispatched at its terminating blank line; a last event the server never
    terminated is dropped, as the SSE rules (and the openai SDK) do.
    """

    __slots__ = (
        "_pending",
        "_held_cr",
        "_data",
        "_choices",
        "_usage",
        "_done",
        "_finish_seen",
        "_error",
        "_events",
        "_reported_error",
    )

    def __init__(self) -> None:
        self._pending: list[bytes] = []
        self._held_cr = False
        self._data: list[bytes] = []
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._done = False
        self._finish_seen = False
        self._error: str | None = None
        self._events = 0
        self._reported_error: Any = None

    @property
    def finish_seen(self) -> bool:
        """Whether any choice has carried a non-empty `finish_reason` so far."""
        return self._finish_seen

    @property
    def done(self) -> bool:
        """Whether `data: [DONE]` was seen; later events are ignored."""
        return self._done

    @property
    def usage(self) -> dict[str, Any] | None:
        """The last top-level `usage` object seen, or None."""
        return self._usage

    def feed(self, chunk: bytes) -> None:
        """Consume one chunk of the response body, split anywhere."""
        if self._held_cr:
            chunk = b"\r" + chunk
            self._held_cr = False
        if chunk.endswith(b"\r"):
            # It may be the first half of a CRLF split across chunks: decide on the next feed.
            chunk = chunk[:-1]
            self._held_cr = True
        cut = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if cut < 0:
            if chunk:
                self._pending.append(chunk)
            return
        lines = chunk[: cut + 1]
        if self._pending:
            self._pending.append(lines)
            lines = b"".join(self._pending)
            self._pending = []
        if cut + 1 < len(chunk):
            self._pending.append(chunk[cut + 1 :])
        for line in lines.splitlines():
            if line:
                self._field(line)
            elif self._data:
                self._dispatch()

    def _field(self, line: bytes) -> None:
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            self._data.append(b"")

    def _dispatch(self) -> None:
        data = self._data
        self._data = []
        if self._done or self._error is not None:
            return
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        if payload.strip() == b"[DONE]":
            self._done = True
            return
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            self._error = (
                f"unreadable stream: a data payload is not JSON ({exc}): "
                f"{payload[:_PAYLOAD_PREVIEW]!r}"
            )
            return
        if not isinstance(event, dict):
            self._error = (
                f"unreadable stream: a data payload is not a JSON object: "
                f"{payload[:_PAYLOAD_PREVIEW]!r}"
            )
            return
        self._events += 1
        self._event(event)

    def _event(self, event: dict[str, Any]) -> None:
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        if "error" in event:
            self._reported_error = event["error"]
        choices = event.get("choices")
        if choices is None:
            return
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            self._error = f"unreadable stream: `choices` is not a list of objects: {choices!r:.200}"
            return
        for choice in choices:
            self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        state = _indexed(self._choices, choice, _Choice)
        finish_reason = choice.get("finish_reason")
        if isinstance(finish_reason, str) and finish_reason:
            state.finish_reason = finish_reason
            self._finish_seen = True
        delta = choice.get("delta")
        if isinstance(delta, dict):
            state.apply(delta)

    def result(self) -> tuple[dict[str, Any], str]:
        """The first choice's assembled message and finish_reason (http.md §8).

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

"""Incremental assembly of an Anthropic Messages SSE stream into one canonical reply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from skycap.dialects.sse import EVENTS_BEFORE_SHAPES, EventStream, StreamError


class _Block:
    __slots__ = ("start", "text", "signature", "json")

    def __init__(self, start: dict[str, Any]) -> None:
        self.start = start
        self.text: list[str] = []
        self.signature: list[str] = []
        self.json: list[str] = []

    def block(self) -> dict[str, Any]:
        """The finished content block, as a non-streamed reply would hold it."""
        out = dict(self.start)
        kind = out.get("type")
        if kind == "text":
            out["text"] = out.get("text", "") + "".join(self.text)
        elif kind == "thinking":
            out["thinking"] = out.get("thinking", "") + "".join(self.text)
            out["signature"] = (out.get("signature") or "") + "".join(self.signature)
        elif self.json:
            raw = "".join(self.json)
            try:
                out["input"] = orjson.loads(raw) if raw.strip() else {}
            except orjson.JSONDecodeError as exc:
                raise StreamError(
                    f"unreadable stream: a {kind} block's input is not JSON ({exc}): {raw[:200]!r}"
                ) from None
        return out


class MessagesAssembler(EventStream):
    """Feed a Messages SSE stream as it arrives; ask for the reply at the end.

    Relay use (as for chat): after each `feed(chunk)`, hold `chunk` back once
    `finish_seen` is true, i.e. from the `message_delta` carrying a `stop_reason`; `done`
    turns on at `message_stop`. `ping` and `content_block_stop` events are passed by
    unparsed (`EventStream`); an `error` event is remembered and named by `result()`.
    """

    READS = frozenset(
        {
            b"message_start",
            b"content_block_start",
            b"content_block_delta",
            b"message_delta",
            b"message_stop",
            b"error",
        }
    )

    __slots__ = ("_reply", "_blocks", "_usage", "_stop", "_reported_error")

    def __init__(
        self, reply: Callable[[list[dict[str, Any]], str], tuple[dict[str, Any], str]]
    ) -> None:
        """`reply` reads the finished blocks and stop reason into the canonical reply."""
        super().__init__()
        self._reply = reply
        self._blocks: dict[int, _Block] = {}
        self._usage: dict[str, Any] | None = None
        self._stop: str | None = None
        self._reported_error: Any = None

    @property
    def finish_seen(self) -> bool:
        return self._stop is not None

    @property
    def usage(self) -> dict[str, Any] | None:
        """`message_start`'s usage updated by `message_delta`'s (Anthropic's own keys)."""
        return self._usage

    def _merge_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self._usage = {**(self._usage or {}), **usage}

    def _event(self, name: bytes | None, event: dict[str, Any]) -> None:
        kind, message, delta = event.get("type"), event.get("message"), event.get("delta")
        # The first of these that carries spans, as skycap.weights.reported_spans reads.
        if event.get("weight_versions") is not None:
            self.note_spans(event)
        elif type(message) is dict and message.get("weight_versions") is not None:
            self.note_spans(message)
        elif type(delta) is dict and delta.get("weight_versions") is not None:
            self.note_spans(delta)
        if kind == "content_block_delta":
            block = self._blocks.get(event.get("index"))  # type: ignore[arg-type]
            if block is None or type(delta) is not dict:
                return
            dtype = delta.get("type")
            pieces = key = None
            if dtype == "text_delta" and isinstance(delta.get("text"), str):
                pieces, key = block.text, "text"
            elif dtype == "thinking_delta" and isinstance(delta.get("thinking"), str):
                pieces, key = block.text, "thinking"
            elif dtype == "signature_delta" and isinstance(delta.get("signature"), str):
                block.signature.append(delta["signature"])
            elif dtype == "input_json_delta" and isinstance(delta.get("partial_json"), str):
                pieces, key = block.json, "partial_json"
            if pieces is not None:
                pieces.append(delta[key])
                # The next pieces of this block, if only the piece differs (EventStream).
                if (
                    self._events > EVENTS_BEFORE_SHAPES
                    and len(delta) == 2
                    and "weight_versions" not in event
                ):
                    self.learn_shape(event, ("delta", key), delta[key], pieces.append)
        elif kind == "content_block_start":
            index, start = event.get("index"), event.get("content_block")
            if (
                type(index) is int
                and isinstance(start, dict)
                and isinstance(start.get("type"), str)
            ):
                self._blocks[index] = _Block(start)
        elif kind == "message_start":
            if isinstance(message, dict):
                self._merge_usage(message.get("usage"))
        elif kind == "message_delta":
            self._merge_usage(event.get("usage"))
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self._stop = delta["stop_reason"]
        elif kind == "message_stop":
            self._done = True
        elif kind == "error":
            self._reported_error = event.get("error")

    def result(self) -> tuple[dict[str, Any], str]:
        """The assembled canonical reply and its canonical finish reason.

        Raises StreamError when a payload was unreadable or no `stop_reason` came.
        """
        if self._error is not None:
            raise StreamError(self._error)
        if self._stop is None:
            ending = "message_stop seen" if self._done else "no message_stop before the end"
            message = f"unreadable stream: no stop_reason in {self._events} JSON events ({ending})"
            if self._reported_error is not None:
                message += f"; the stream reported an error: {self._reported_error!r:.300}"
            raise StreamError(message)
        blocks = [self._blocks[i].block() for i in sorted(self._blocks)]
        try:
            return self._reply(blocks, self._stop)
        except ValueError as exc:
            raise StreamError(f"unreadable stream: {exc}") from None

"""A streamed token-mode call's writing side: the dialect's writer, the splitter, the stream.

The backend opens the relay once nothing can refuse the call (the harness then gets a 200
stream), streams the completion through it (skycap.tokens.streaming), and after parsing
the whole completion sends what the parse has beyond the streamed parts, the end after
the commit, or the dialect's error event for a turn that failed after opening.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from skycap.dialects import Dialect, ReplyData, Request, StreamWriter
from skycap.dialects.writers import stream_writer
from skycap.tokens.deltas import CONTENT, REASONING, DeltaSplitter, Markup
from skycap.tokens.plan import Plan
from skycap.tokens.renderer import RAW_CONTENT_CONTEXT, Renderer
from skycap.tokens.reply import reply_message
from skycap.tokens.sampling import stop_strings
from skycap.tokens.settings import TokenSettings
from skycap.tokens.streaming import ReplyStream, StreamedCompletion, stream_completion

logger = logging.getLogger(__name__)

#: The keys of a parsed reply message; the rest of an issued message is what a dialect issued.
_MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls")


def prompt_opens_thinking(renderer: Renderer, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside an opened thinking block (a template that prefills
    `<think>`), so the completion starts with reasoning. Runs on a renderer thread."""
    steps = renderer.stream_decoder()  # type: ignore[attr-defined]
    tail = "".join(steps(prompt_ids[-RAW_CONTENT_CONTEXT:]))
    return tail.rstrip().endswith(Markup().think_open)


def reasoning_message(
    dialect: Dialect, parsed: dict[str, Any], through: list[int]
) -> dict[str, Any] | None:
    """The issued reasoning of a completion's tokens `through` the end of its thinking."""
    reasoning = parsed.get("reasoning_content")
    if not reasoning:
        return None
    message = {"role": "assistant", "content": None, "reasoning_content": reasoning}
    return dialect.issue(message, through, through)


class Relay:
    """One streamed call: its ReplyStream, and the writer and splitter once opened."""

    def __init__(self, stream: ReplyStream) -> None:
        self.stream = stream
        self.writer: StreamWriter | None = None
        self.splitter: DeltaSplitter | None = None
        self._closed = False

    def open(self, writer: StreamWriter) -> None:
        """Nothing can refuse the call any more: the harness gets a 200 stream from here."""
        self.writer = writer
        headers = {"content-type": "text/event-stream", "cache-control": "no-cache"}
        self.stream.open(writer.keepalive, headers)
        self.stream.put(writer.start())

    def writer_or_fail(self) -> StreamWriter:
        assert self.writer is not None, "the relay is not open"
        return self.writer

    async def generate(
        self,
        settings: TokenSettings,
        session_id: str,
        engine_request: dict[str, Any],
        plan: Plan,
        tools: list[Any] | None,
        dialect: Dialect,
        sampling: Mapping[str, Any],
    ) -> StreamedCompletion | None:
        """Stream the completion through this relay; None when the engine's wire or the
        renderer cannot stream. Raises EngineRefused, EngineError or RenderError."""
        pool = settings.pool
        body = settings.engine.stream_request(engine_request, f"skycap-{secrets.token_hex(8)}")
        primary = pool.primary
        if body is None or not hasattr(primary, "stream_decoder"):
            return None
        raw = settings.options.use_raw_content
        stops = stop_strings(sampling)
        thinking = await pool.run(lambda r: prompt_opens_thinking(r, plan.prompt_ids))
        splitter = self.splitter_for(primary, raw, thinking, stops)

        async def reasoning_closed(through: list[int]) -> dict[str, Any] | None:
            parsed = await pool.run(
                lambda r: reply_message(r, through, tools, plan.prompt_ids, use_raw_content=False)
            )
            return reasoning_message(dialect, parsed, through)

        return await stream_completion(
            settings,
            session_id,
            body,
            plan,
            sampling,
            splitter=splitter,
            writer=self.writer_or_fail(),
            reply=self.stream,
            on_reasoning_close=reasoning_closed,
        )

    def splitter_for(
        self, renderer: Renderer, raw: bool, thinking: bool, stops: Sequence[str]
    ) -> DeltaSplitter:
        """The splitter for this call: the renderer's markup, if it has the known one."""
        markup = Markup() if getattr(renderer, "stream_markup", False) else None
        hold = max((len(s) for s in stops), default=1) - 1
        self.splitter = DeltaSplitter(markup, raw=raw, thinking=thinking, hold=hold)
        return self.splitter

    def finish_parts(self, stored: dict[str, Any], issued: dict[str, Any] | None) -> dict[str, Any]:
        """Send what the parse has beyond the streamed parts; the message to store.

        The reasoning issued while streaming keeps the ids it was sent with; a thinking
        block that never closed is closed now, with the whole completion's signature.
        When nothing streamed (the engine's wire or the renderer cannot), all of it is
        sent now, after the start the stream opened with.
        """
        writer = self.writer_or_fail()
        if self.splitter is None:
            self.splitter = DeltaSplitter(None, raw=True, thinking=False, hold=0)
        if issued is not None and issued.get("reasoning_content") == stored.get(
            "reasoning_content"
        ):
            stored = {**stored, **{k: v for k, v in issued.items() if k not in _MESSAGE_KEYS}}
        elif stored.get("reasoning_content"):
            self._send(REASONING, stored.get("reasoning_content"))
            data, stored = writer.reasoning_done(stored)
            self.stream.put(data)
        content = stored.get("content")
        self._send(CONTENT, content if isinstance(content, str) else None)
        return stored

    def _send(self, part: str, final: str | None) -> None:
        assert self.splitter is not None
        rest = self.splitter.remainder(part, final)
        if rest is None:
            logger.info("streamed %s differs from the parsed reply; the record has the parse", part)
        elif rest:
            self.stream.put(self.writer_or_fail().delta(part, rest))

    def end(self, data: ReplyData) -> None:
        """After the commit: the rest of the reply (tool calls, the finish)."""
        self.stream.put(self.writer_or_fail().end(data))
        self.stream.close()
        self._closed = True

    def fail(self, status: int, body: bytes) -> None:
        """End an opened stream with the dialect's error event for a turn that failed
        (`body` is the dialect's error JSON); nothing when it was not opened or is done."""
        if self.writer is None or self._closed:
            return
        self._closed = True
        self.stream.put(error_event(self.writer_or_fail(), status, body))
        self.stream.close()


def waiting_writer(dialect: Dialect, request: Request) -> StreamWriter:
    """A writer for a stream that waits for a reply written elsewhere (a retry waiting on
    its original): only its `keepalive` and `error` are used, never `start`."""
    model = request.model if isinstance(request.model, str) else ""
    head = ReplyData(dialect.reply_id(), int(time.time()), model, {}, "", 0, 0, request)
    return stream_writer(dialect, head, ())


def error_event(writer: StreamWriter, status: int, body: bytes) -> bytes:
    """The dialect's error event for a failure whose error JSON is `body`."""
    try:
        message = _error_message(orjson.loads(body))
    except orjson.JSONDecodeError:
        message = body.decode("utf-8", "replace")
    return writer.error(status, message)


def _error_message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else str(body)

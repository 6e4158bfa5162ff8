"""A token-mode reply streamed to the harness as the engine generates it.

`ReplyStream` is the harness's side: the bytes of the reply, queued as they are written,
read by the server with a keep-alive after every silence of `keepalive` seconds.
`stream_completion` is the engine's side: it posts the streamed generate request, reads
the chunks with the engine wire's stream reader a socket read at a time, decodes the
tokens they carry and sends the reasoning and content deltas the splitter frees
(skycap.tokens.deltas) through the dialect's writer, one write per read: when the engine
is ahead of skycap, whatever arrived since the last read goes out at once, one delta per
part, so the cost per token falls as the load rises. Nothing ready is held back for it.
A stop string is cut where it completes and the engine request is aborted. Parsing the
whole completion, the commit and the end of the stream stay with the turn, so a streamed
and a buffered reply go through one path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from skycap.dialects import StreamWriter
from skycap.tokens.deltas import REASONING, DeltaSplitter
from skycap.tokens.engine import EngineOutput
from skycap.tokens.plan import Plan
from skycap.tokens.renderer import RAW_CONTENT_CONTEXT
from skycap.tokens.sampling import stop_strings
from skycap.tokens.settings import TokenSettings
from skycap.tokens.stops import StopMatch, cut_completion, find_stop

log = logging.getLogger(__name__)


class ReplyStream:
    """The bytes of one streamed reply on their way to the harness.

    The backend `open`s it once nothing can refuse the call any more (then the server
    answers 200 and streams), `put`s bytes and `close`s it; the server iterates `chunks()`.
    Writing never waits on the harness: a harness that went away leaves bytes unread, and
    the call still commits.
    """

    def __init__(self, keepalive: float) -> None:
        self.keepalive = keepalive
        self.opened = asyncio.Event()
        self.headers: dict[str, str] = {}
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._keepalive: Callable[[], bytes] = bytes
        #: Set by the server when the harness did not read the stream to its end.
        self.harness_left = False
        #: Whether `close()` was called: the reply's last bytes are written.
        self.closed = False

    def open(self, keepalive: Callable[[], bytes], headers: dict[str, str]) -> None:
        """Start answering; `keepalive` makes the bytes sent after each silence."""
        self._keepalive = keepalive
        self.headers = headers
        self.opened.set()

    def put(self, data: bytes) -> None:
        if data:
            self._queue.put_nowait(data)

    def close(self) -> None:
        self.closed = True
        self._queue.put_nowait(None)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The reply's bytes as written, with a keep-alive after each silence; ends at close.

        Everything written while the reader was busy goes out joined, as one piece: a slow
        harness connection costs one send per wake-up, not one per delta.
        """
        queue = self._queue
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), self.keepalive)
            except TimeoutError:
                if queue.empty():  # bytes put as the wait ran out go first
                    yield self._keepalive()
                continue
            if item is None:
                return
            pieces = [item]
            while not queue.empty():
                item = queue.get_nowait()
                if item is None:
                    yield b"".join(pieces)
                    return
                pieces.append(item)
            yield b"".join(pieces) if len(pieces) > 1 else item


class EngineRefused(Exception):
    """The engine answered the streamed request with an HTTP error status."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body


@dataclass
class StreamedCompletion:
    """What a streamed generation left: the output (cut at a stop string, if one ended it),
    the stop match, and the reasoning message issued when the thinking ended, if it did."""

    output: EngineOutput
    stop: StopMatch | None
    reasoning: dict[str, Any] | None


#: Called with the completion's tokens through the end of its thinking; returns the issued
#: reasoning message (what the writer closes the thinking with), or None.
ReasoningClose = Callable[[list[int]], Awaitable[dict[str, Any] | None]]


async def stream_completion(
    settings: TokenSettings,
    session_id: str,
    body: dict[str, Any],
    plan: Plan,
    sampling: Mapping[str, Any],
    *,
    splitter: DeltaSplitter,
    writer: StreamWriter,
    reply: ReplyStream,
    on_reasoning_close: ReasoningClose,
) -> StreamedCompletion:
    """Generate with the engine's stream, relaying deltas; raises EngineError or EngineRefused.

    `body` is the wire's streamed request; `sampling` the turn's, whose stop strings are cut
    here. With `--use-raw-content` the thinking is content, so its end is not looked for.
    """
    client, pool = settings.client, settings.pool
    prompt_ids = plan.prompt_ids
    stops = stop_strings(sampling)
    min_tokens = sampling.get("min_tokens") or 0
    skip_special_tokens = settings.skip_special_tokens
    think_end = None if settings.options.use_raw_content else settings.think_end
    stream = settings.engine.stream_reader(plan.routes_from)
    context = list(prompt_ids[-RAW_CONTENT_CONTEXT:])
    decode = await pool.run(lambda r: r.stream_decoder(context))
    longest = max((len(s) for s in stops), default=0)
    ending = frozenset(settings.stop_token_ids)  # the token that ends generation is not text
    stop: StopMatch | None = None
    issued: dict[str, Any] | None = None
    async with client.stream(session_id, orjson.dumps(body)) as (status, batches):
        if status != 200:
            assert isinstance(batches, bytes)
            raise EngineRefused(status, batches)
        assert not isinstance(batches, bytes)
        async for batch in batches:
            first = len(stream.token_ids)
            ids = [token for chunk in batch for token in stream.feed(chunk)]
            if not ids:
                continue
            # Each step of the incremental decoder is O(1) and takes microseconds, so the
            # batch is decoded here: a hop to a renderer thread would cost more than it.
            pieces = decode(ids)
            out: list[bytes] = []  # what this batch frees, sent as one write
            for offset, (token, piece) in enumerate(zip(ids, pieces, strict=True)):
                if token in ending:
                    continue
                splitter.add(piece)
                if stops and any(s in splitter.text[-(len(piece) + longest) :] for s in stops):
                    stop = await pool.run(
                        lambda r: find_stop(
                            r,
                            stream.token_ids,
                            stops,
                            prompt_ids,
                            min_tokens=min_tokens,
                            skip_special_tokens=skip_special_tokens,
                        )
                    )
                    if stop is not None:
                        break  # what the stop string leaves is sent from the parse
                if token == think_end and splitter.in_reasoning:
                    out.extend(writer.delta(part, text) for part, text in splitter.take())
                    reply.put(b"".join(out))
                    out.clear()
                    issued = await _close_reasoning(
                        stream.token_ids[: first + offset + 1],
                        splitter,
                        writer,
                        reply,
                        on_reasoning_close,
                    )
            if stop is None:
                out.extend(writer.delta(part, text) for part, text in splitter.take())
            reply.put(b"".join(out))
            if stop is not None:
                if stream.request_id is not None and not stream.finished:
                    await client.abort(stream.request_id)
                break
    output = stream.finish(stopped=stop is not None)
    if stop is not None:
        cut_completion(output, stop.keep, len(prompt_ids))
    return StreamedCompletion(output, stop, issued)


async def _close_reasoning(
    through: list[int],
    splitter: DeltaSplitter,
    writer: StreamWriter,
    reply: ReplyStream,
    on_reasoning_close: ReasoningClose,
) -> dict[str, Any] | None:
    """The thinking ended: send the rest of it as the parse reads it, then close it."""
    issued = await on_reasoning_close(through)
    if issued is not None:
        rest = splitter.remainder(REASONING, issued.get("reasoning_content"))
        if rest is None:
            log.info(
                "streamed reasoning differs from the parsed reasoning; the record has the parse"
            )
        elif rest:
            reply.put(writer.delta(REASONING, rest))
        data, issued = writer.reasoning_done(issued)
        reply.put(data)
    splitter.close_reasoning()
    return issued

"""The one server on 127.0.0.1 that mitmproxy re-targets flows to, on its own event loop.

mitmproxy sends a response an addon builds in one piece and ties its forwarding to the
client connection, so whatever skycap must write over time is served from a loopback
port instead, and the harness's flow is pointed at it (`retarget`): a text-mode reply
relayed as skycap reads it from the upstream (`UpstreamRelay`), a token-mode reply sent
as it is generated (`GeneratedReply`), the 413 after draining an oversize body
(`Drained`). Each registered answer is served once, at its own unguessable path.

The base-URL listener (`frontdoor`) takes a re-targeted flow's answer here (`take`) and
writes it to the harness itself, without the hop; the proxy listener and WebSocket
calls still go through the port. An answer is the same object either way (`open`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator
from typing import Protocol

from mitmproxy import http

from skycap.server.upstream import chunk
from skycap.tokens.streaming import ReplyStream

_PREFIX = b"/loopback/"
_READ = 1 << 20
_ERRORS = (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)
#: Response headers that describe one transfer, rebuilt by this hop.
_TRANSFER = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})


class Broken(Exception):
    """An answer's body broke off: its response must end without its last chunk."""


class Opened:
    """An answer's response: status, headers (no transfer headers) and body pieces, which
    raise `Broken` when the body breaks off; `close` asks the hop to close after it."""

    __slots__ = ("status", "headers", "pieces", "close")

    def __init__(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        pieces: AsyncIterator[bytes],
        close: bool = False,
    ) -> None:
        self.status = status
        self.headers = headers
        self.pieces = pieces
        self.close = close


class Answer(Protocol):
    """Something the loopback serves once: writes its response, says whether to keep the
    connection open for the next request mitmproxy sends on it."""

    async def serve(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool: ...

    def abandoned(self) -> None:
        """The connection failed before the answer was written to its end."""


class ResponseAnswer:
    """An answer that is one HTTP response (`open`), which the base-URL listener can
    write to the harness itself; on the port it goes out chunked."""

    __slots__ = ()

    async def open(self, body_size: int, body: asyncio.StreamReader) -> Opened:
        """The response; `body` holds the request's `body_size` bytes, unread."""
        raise NotImplementedError

    def abandoned(self) -> None:
        """The connection failed before the answer was written to its end."""

    async def serve(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        opened = await self.open(_content_length(head), reader)
        lines = [b"HTTP/1.1 %d OK" % opened.status, *(k + b": " + v for k, v in opened.headers)]
        lines.append(b"transfer-encoding: chunked")
        if opened.close:
            lines.append(b"connection: close")
        writer.write(b"\r\n".join(lines) + b"\r\n\r\n")
        await writer.drain()
        try:
            async for data in opened.pieces:  # each piece one chunk, drained before the next
                writer.write(chunk(data))
                await writer.drain()
        except Broken:
            return False  # no terminator: the reader sees the body break off
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return not opened.close


class Loopback:
    """Listens on a free 127.0.0.1 port from `start()` until `close()`."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._answers: dict[bytes, Answer] = {}
        # Paths are a secret prefix and a count: as unguessable to another local process
        # as a fresh token each, which would cost a system call per answer.
        self._prefix = _PREFIX + secrets.token_hex(16).encode() + b"-"
        self._count = itertools.count()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def register(self, answer: Answer) -> bytes:
        """The path a flow is re-targeted to for `answer` (served once)."""
        path = b"%s%d" % (self._prefix, next(self._count))
        self._answers[path] = answer
        return path

    def forget(self, path: bytes) -> None:
        """The flow never reached the loopback (the harness left first)."""
        self._answers.pop(path, None)

    def take(self, flow: http.HTTPFlow) -> ResponseAnswer | None:
        """The response a flow re-targeted here is for (now taken), or None for another
        flow or an answer that must own the connection (a WebSocket's sink)."""
        data = flow.request.data
        if data.port != self.port or data.host != "127.0.0.1":
            return None
        answer = self._answers.get(data.path)
        if not isinstance(answer, ResponseAnswer):
            return None
        del self._answers[data.path]
        return answer

    def retarget(self, flow: http.HTTPFlow, answer: Answer, *, body: bool = False) -> bytes:
        """Point `flow` at this server for `answer`; its request body goes along only with
        `body` (a body to drain). Returns the path, for `forget`."""
        path = self.register(answer)
        data = flow.request.data
        data.scheme, data.host, data.port = b"http", "127.0.0.1", self.port
        data.path = path
        if not body:
            data.headers.fields = ((b"host", b"127.0.0.1"), (b"content-length", b"0"))
            data.content = b""
        return path

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Keep-alive: mitmproxy reuses a connection for the next re-targeted flow of a client."""
        with contextlib.suppress(*_ERRORS):
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    answer = self._answers.pop(head.split(b" ", 2)[1], None)
                    if answer is None:
                        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                        await writer.drain()
                        continue
                    written = False
                    try:
                        keep = await answer.serve(head, reader, writer)
                        written = True
                    finally:
                        if not written:
                            answer.abandoned()
                    if not keep:
                        return
            finally:
                with contextlib.suppress(OSError):
                    writer.close()


class UpstreamRelay(ResponseAnswer):
    """A text-mode reply relayed as skycap reads it: status, headers, then the chunks the
    call's task `put`s, until `END` (the chunked terminator) or `BROKEN` (the upstream
    broke: the connection closes without one, so the harness sees a failed stream).

    One writer waits on one producer, so a deque and the writer's one future do what an
    `asyncio.Queue` would, for less per chunk (a stream's chunks are many).
    """

    END = b""
    BROKEN = None
    __slots__ = ("status", "headers", "_queued", "_waiter")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = [(k, v) for k, v in headers if k.lower() not in _TRANSFER]
        self._queued: collections.deque[bytes | None] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, piece: bytes | None) -> None:
        """Queue a piece of the body, or `END` or `BROKEN`, and wake the writer."""
        self._queued.append(piece)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def open(self, body_size: int, body: asyncio.StreamReader) -> Opened:
        return Opened(self.status, self.headers, self._pieces())

    def abandoned(self) -> None:
        """The task reads the upstream to its end regardless."""

    async def _pieces(self) -> AsyncIterator[bytes]:
        """Whatever is queued goes out joined, as one piece: when the upstream is ahead of
        the harness, one write carries what arrived meanwhile."""
        queued = self._queued
        while True:
            if not queued:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            pieces = []
            while queued:
                piece = queued.popleft()
                if piece is self.BROKEN or piece == self.END:
                    if pieces:
                        yield b"".join(pieces)
                    if piece is self.BROKEN:
                        raise Broken("the upstream broke off")
                    return
                pieces.append(piece)
            if pieces:
                yield pieces[0] if len(pieces) == 1 else b"".join(pieces)


class GeneratedReply(ResponseAnswer):
    """A token-mode reply sent as it is written (its `ReplyStream`, with keep-alives); a
    harness that does not read it to its end is marked on the stream (`harness_left`)."""

    __slots__ = ("stream",)

    def __init__(self, stream: ReplyStream) -> None:
        self.stream = stream

    async def open(self, body_size: int, body: asyncio.StreamReader) -> Opened:
        headers = [(k.encode(), v.encode()) for k, v in self.stream.headers.items()]
        return Opened(200, headers, self.stream.chunks(), close=True)

    def abandoned(self) -> None:
        self.stream.harness_left = True


class Drained(ResponseAnswer):
    """An oversize request body read and discarded, then answered 413 with `body` (the
    caller's error shape): a client still sending would see a reset if the connection
    were simply closed."""

    __slots__ = ("body",)

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def open(self, body_size: int, body: asyncio.StreamReader) -> Opened:
        remaining = body_size
        while remaining > 0:
            data = await body.read(min(_READ, remaining))
            if not data:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(data)
        return Opened(413, [(b"content-type", b"application/json")], _once(self.body), close=True)

    def abandoned(self) -> None:
        """Nothing waits on a drained body."""


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body

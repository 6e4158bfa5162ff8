"""The one server on 127.0.0.1 that mitmproxy re-targets flows to, on its own event loop.

mitmproxy sends a response an addon builds in one piece and ties its forwarding to the
client connection, so whatever skycap must write over time is served from a loopback
port instead, and the harness's flow is pointed at it (`retarget`): a text-mode reply
relayed as skycap reads it from the upstream (`UpstreamRelay`), a token-mode reply sent
as it is generated (`GeneratedReply`), the 413 after draining an oversize body
(`Drained`). Each registered answer is served once, at its own unguessable path.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Protocol

from mitmproxy import http

from skycap.tokens.streaming import ReplyStream

_PREFIX = b"/loopback/"
_READ = 1 << 20
_ERRORS = (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)
#: Response headers that describe one transfer, rebuilt by this hop.
_TRANSFER = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})


class Answer(Protocol):
    """Something the loopback serves once: writes its response, says whether to keep the
    connection open for the next request mitmproxy sends on it."""

    async def serve(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool: ...

    def abandoned(self) -> None:
        """The connection failed before the answer was written to its end."""


class Loopback:
    """Listens on a free 127.0.0.1 port from `start()` until `close()`."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._answers: dict[bytes, Answer] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def register(self, answer: Answer) -> bytes:
        """The path a flow is re-targeted to for `answer` (served once)."""
        path = _PREFIX + secrets.token_hex(16).encode()
        self._answers[path] = answer
        return path

    def forget(self, path: bytes) -> None:
        """The flow never reached the loopback (the harness left first)."""
        self._answers.pop(path, None)

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


def _head(status: bytes, headers: list[tuple[bytes, bytes]], close: bool) -> bytes:
    lines = [b"HTTP/1.1 " + status, *(k + b": " + v for k, v in headers)]
    lines.append(b"transfer-encoding: chunked")
    if close:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _chunked(writer: asyncio.StreamWriter, pieces: AsyncIterator[bytes]) -> None:
    """Each piece as one HTTP chunk, drained before the next is awaited."""
    async for data in pieces:
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()


class UpstreamRelay:
    """A text-mode reply relayed as skycap reads it: status, headers, then the chunks the
    call's task queues, until `END` (the chunked terminator) or `BROKEN` (the upstream
    broke: the connection closes without one, so the harness sees a failed stream)."""

    END = b""
    BROKEN = None
    __slots__ = ("status", "headers", "chunks")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = [(k, v) for k, v in headers if k.lower() not in _TRANSFER]
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def serve(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        writer.write(_head(b"%d OK" % self.status, self.headers, close=False))
        ended: list[bytes | None] = []
        await _chunked(writer, self._pieces(ended))
        if ended[0] is self.BROKEN:
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    def abandoned(self) -> None:
        """The task reads the upstream to its end regardless."""

    async def _pieces(self, ended: list[bytes | None]) -> AsyncIterator[bytes]:
        """Whatever is queued goes out joined, as one piece: when the upstream is ahead of
        this hop, mitmproxy then reads, and relays, one piece instead of many."""
        queue = self.chunks
        while True:
            chunk = await queue.get()
            pieces = []
            while chunk is not self.BROKEN and chunk != self.END:
                pieces.append(chunk)
                if queue.empty():
                    break
                chunk = queue.get_nowait()
            if pieces:
                yield b"".join(pieces)
            if chunk is self.BROKEN or chunk == self.END:
                ended.append(chunk)
                return


class GeneratedReply:
    """A token-mode reply sent as it is written (its `ReplyStream`, with keep-alives); a
    harness that does not read it to its end is marked on the stream (`harness_left`)."""

    __slots__ = ("stream",)

    def __init__(self, stream: ReplyStream) -> None:
        self.stream = stream

    async def serve(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        headers = [(k.encode(), v.encode()) for k, v in self.stream.headers.items()]
        writer.write(_head(b"200 OK", headers, close=True))
        await writer.drain()
        await _chunked(writer, self.stream.chunks())
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return False

    def abandoned(self) -> None:
        self.stream.harness_left = True


class Drained:
    """An oversize request body read and discarded, then answered 413 with `body` (the
    caller's error shape): a client still sending would see a reset if the connection
    were simply closed."""

    __slots__ = ("body",)

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def serve(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        remaining = _content_length(head)
        while remaining > 0:
            data = await reader.read(min(_READ, remaining))
            if not data:
                return False
            remaining -= len(data)
        body = self.body
        writer.write(
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        return False

    def abandoned(self) -> None:
        """Nothing waits on a drained body."""


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0

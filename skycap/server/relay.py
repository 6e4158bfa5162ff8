"""A loopback server that hands a streamed text-mode reply to mitmproxy as it arrives.

mitmproxy cannot stream a response an addon builds, and its own forwarding dies with the
harness connection. So skycap reads a streamed reply itself (`textmode`), on its own task,
and re-targets the harness's flow to this server (127.0.0.1, a free port, mitmproxy's
event loop), which writes the chunks the task queues as a chunked HTTP/1.1 body. When the
harness goes away only this hop ends; the task reads the upstream to its end regardless.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

from skycap.server.loopback import LoopbackServer

END = b""  # queued after the last chunk: write the chunked terminator
BROKEN = None  # queued when the upstream broke: close without a terminator
_DROPPED = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})


class Stream:
    """One relayed reply: its status line, headers and the queue of chunks still to write."""

    __slots__ = ("status", "headers", "chunks")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = [(k, v) for k, v in headers if k.lower() not in _DROPPED]
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()


class StreamRelay(LoopbackServer):
    """Serves each registered stream once, at `/relay/{n}`, until `close()`."""

    def __init__(self) -> None:
        super().__init__()
        self._streams: dict[bytes, Stream] = {}
        self._ids = itertools.count(1)

    def register(self, stream: Stream) -> bytes:
        """The path the harness's flow is re-targeted to; it serves `stream` once."""
        path = b"/relay/%d" % next(self._ids)
        self._streams[path] = stream
        return path

    def forget(self, path: bytes) -> None:
        """The flow never reached the relay (the harness left first)."""
        self._streams.pop(path, None)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Keep-alive: mitmproxy reuses this connection for the next relayed call of a client."""
        with contextlib.suppress(OSError, ValueError, asyncio.IncompleteReadError):
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    stream = self._streams.pop(head.split(b" ", 2)[1], None)
                    if stream is None:
                        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                        await writer.drain()
                        continue
                    if not await _write(stream, writer):
                        return
            finally:
                writer.close()


async def _write(stream: Stream, writer: asyncio.StreamWriter) -> bool:
    """Status, headers, then chunks until END (True) or BROKEN (False: close the connection)."""
    lines = [b"HTTP/1.1 %d OK" % stream.status]
    lines += [k + b": " + v for k, v in stream.headers]
    lines.append(b"transfer-encoding: chunked")
    writer.write(b"\r\n".join(lines) + b"\r\n\r\n")
    queue = stream.chunks
    while True:
        chunk = await queue.get()
        # Whatever else is queued goes out with it, as one HTTP chunk: when the upstream is
        # ahead of this hop, mitmproxy then reads, and relays, one piece instead of many.
        pieces = []
        while chunk is not BROKEN and chunk != END:
            pieces.append(chunk)
            if queue.empty():
                break
            chunk = queue.get_nowait()
        if pieces:
            data = b"".join(pieces)
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        if chunk is BROKEN:
            return False
        if chunk == END:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        await writer.drain()

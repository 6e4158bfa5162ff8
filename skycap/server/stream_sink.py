"""A loopback server that sends streamed token-mode replies as they are written.

mitmproxy sends a response the addon builds in one piece, so a reply generated while the
harness waits is served from here instead: the harness's flow is re-targeted to
`/stream/{key}` on this server (127.0.0.1, a free port, on mitmproxy's own event loop)
and its response is passed through unbuffered (`flow.response.stream`). The body is the
ReplyStream's bytes, chunked, with a keep-alive after each silence. A harness that goes
away closes the connection; the call behind it runs on and commits all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets

from skycap.server.loopback import LoopbackServer
from skycap.tokens.streaming import ReplyStream

STREAM_PREFIX = b"/stream/"


class StreamSink(LoopbackServer):
    """Serves registered ReplyStreams on 127.0.0.1 until `close()`."""

    def __init__(self) -> None:
        super().__init__()
        self._streams: dict[bytes, ReplyStream] = {}

    def register(self, stream: ReplyStream) -> bytes:
        """The path a flow is re-targeted to for `stream` (served once)."""
        key = secrets.token_hex(16).encode()
        self._streams[key] = stream
        return STREAM_PREFIX + key

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream: ReplyStream | None = None
        finished = False
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            stream = self._streams.pop(path.removeprefix(STREAM_PREFIX), None)
            if stream is None or not path.startswith(STREAM_PREFIX):
                writer.write(
                    b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                )
                return
            headers = b"".join(
                k.encode() + b": " + v.encode() + b"\r\n" for k, v in stream.headers.items()
            )
            writer.write(
                b"HTTP/1.1 200 OK\r\n" + headers + b"transfer-encoding: chunked\r\n"
                b"connection: close\r\n\r\n"
            )
            await writer.drain()
            async for data in stream.chunks():
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            finished = True
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            if stream is not None and not finished:
                stream.harness_left = True
            with contextlib.suppress(OSError):
                writer.close()

"""A loopback sink that reads and discards an oversize request body, then answers 413.

mitmproxy cannot answer a request before reading its body, and a client that is still
sending would see a reset rather than the 413 if the connection were simply closed. So
a request whose Content-Length is over `--max-body-size` is streamed (never buffered) to
this sink, which drains it and answers with skycap's own error naming the limit.
"""

from __future__ import annotations

import asyncio
import contextlib

from skycap.dialects.chat import openai_error
from skycap.dialects.messages import anthropic_error
from skycap.server.loopback import LoopbackServer
from skycap.wire import control_error

HARNESS_PATH = b"/harness"
MESSAGES_HARNESS_PATH = b"/harness/messages"  # an Anthropic caller: its error shape
CONTROL_PATH = b"/control"
_READ = 1 << 20


def too_large_message(size: int | None, limit: int) -> str:
    what = "the request body" if size is None else f"the request body of {size} bytes"
    return (
        f"{what} is over the limit of {limit} bytes; send a smaller body or start the server "
        "with a larger --max-body-size"
    )


class DrainSink(LoopbackServer):
    """Drains and answers each oversize request it is sent, until `close()`."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(
            OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError
        ):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                size = _content_length(head)
                remaining = size
                while remaining > 0:
                    data = await reader.read(min(_READ, remaining))
                    if not data:
                        return
                    remaining -= len(data)
                message = too_large_message(size, self.limit)
                if path == HARNESS_PATH:
                    body = openai_error(413, message)
                elif path == MESSAGES_HARNESS_PATH:
                    body = anthropic_error(413, message)
                else:
                    body = control_error(message)
                writer.write(
                    b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
            finally:
                writer.close()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0

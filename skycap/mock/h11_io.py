"""HTTP/1.1 over asyncio streams with h11 for the scripted upstreams: a request read whole,
the heads of a JSON and of an SSE answer, and a JSON answer sent in one write.
"""

from __future__ import annotations

import asyncio

import h11

READ_SIZE = 65536


async def read_request(
    conn: h11.Connection, reader: asyncio.StreamReader
) -> tuple[h11.Request, bytes] | None:
    """The next request's head and whole body, or None when the client closed."""
    head: h11.Request | None = None
    body: list[bytes] = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(READ_SIZE))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            return head, b"".join(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None


def json_head(status: int, length: int) -> h11.Response:
    """The head of a JSON answer of `length` bytes."""
    headers = [("content-type", "application/json"), ("content-length", str(length))]
    return h11.Response(status_code=status, headers=headers)


def stream_head() -> h11.Response:
    """The head of an SSE answer (no length: h11 sends it chunked)."""
    headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
    return h11.Response(status_code=200, headers=headers)


async def send_json(
    conn: h11.Connection, writer: asyncio.StreamWriter, status: int, body: bytes
) -> None:
    """A whole JSON answer: head, body and end in one write."""
    writer.write(
        conn.send(json_head(status, len(body)))
        + conn.send(h11.Data(data=body))
        + conn.send(h11.EndOfMessage())
    )
    await writer.drain()

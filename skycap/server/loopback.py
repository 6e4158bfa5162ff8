"""A server on 127.0.0.1 that mitmproxy re-targets flows to, on mitmproxy's own event loop.

mitmproxy sends a response an addon builds in one piece and ties its forwarding to the
client connection, so whatever skycap must write over time (a relayed or generated
stream, the 413 after draining an oversize body) is served from a loopback port instead,
and the harness's flow is pointed at it. Each kind says what it serves in `_handle`.
"""

from __future__ import annotations

import asyncio


class LoopbackServer:
    """Listens on a free 127.0.0.1 port from `start()` until `close()`."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

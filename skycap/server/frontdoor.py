"""The base-URL listener: HTTP/1.1 served straight to the addon's hooks, not mitmproxy's layers.

mitmproxy's layers cost a no-op reverse proxy two to four times the CPU per call of a
minimal Python relay (docs/performance.md "Text mode"), while skycap's own work is a small
part of a call. So `skycap serve` and CaptureService answer the base-URL port here: each
request becomes the same `HTTPFlow` mitmproxy would build and goes through the same addon
hooks in mitmproxy's order (`requestheaders`, `request`, `responseheaders`, `response`,
`error`, `client_disconnected`). A flow the hooks answer is written as it is; a flow they
re-target (an upstream, or skycap's loopback for answers written over time) is forwarded
with a pooled keep-alive client, its body streamed when `responseheaders` asks. Capture
has one implementation, the addon; this is only its transport.

What this loop does not speak goes to mitmproxy's own reverse listener on the same
connection, untouched: a WebSocket upgrade (the Responses WebSocket), `Expect`, HTTP/2, an
absolute-form target, a head it cannot parse. The proxy listener (HTTPS_PROXY) and
`mitmdump -s addons/skycap.py` are mitmproxy's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from mitmproxy import connection, flow, http
from mitmproxy.connection import ConnectionState
from mitmproxy.net.http import http1
from mitmproxy.proxy.mode_specs import ProxyMode

from skycap.server import messages
from skycap.server.loopback import Broken, ResponseAnswer
from skycap.server.messages import request_head
from skycap.server.upstream import UpstreamError, UpstreamPool, chunk, read_chunked, unread

logger = logging.getLogger("skycap.server")

#: The longest request head read here; a longer one goes to mitmproxy, which answers it.
HEAD_LIMIT = 1 << 16
#: Connections the kernel queues for a busy loop to accept: a GRPO burst opens hundreds at
#: once (asyncio's default is 100; the kernel caps it at net.core.somaxconn).
BACKLOG = 1024
_READ = 1 << 16
#: A streamed answer waits for the harness to read once this much is unsent.
_BUFFERED = 1 << 16
CLIENT_GONE = "Client disconnected."
_HOOKS = (
    "requestheaders",
    "request",
    "responseheaders",
    "response",
    "error",
    "client_disconnected",
)
#: Response headers that describe one transfer: rebuilt for the harness.
_TRANSFER = frozenset({b"content-length", b"transfer-encoding"})

HandOver = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class _Protocol(asyncio.StreamReaderProtocol):
    """A stream protocol that keeps the connection's mitmproxy `Client` up to date, as
    mitmproxy's own handler does, so a hook can tell whether the harness is still there."""

    def __init__(self, door: FrontDoor) -> None:
        super().__init__(asyncio.StreamReader(limit=HEAD_LIMIT), door._serve)
        self.client: connection.Client | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = connection.Client(
            peername=transport.get_extra_info("peername"),
            sockname=transport.get_extra_info("sockname"),
            timestamp_start=time.time(),
        )
        self.client.state = ConnectionState.OPEN
        super().connection_made(transport)

    def eof_received(self) -> bool | None:
        self._mark_closed()
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._mark_closed()
        super().connection_lost(exc)

    def _mark_closed(self) -> None:
        if self.client is not None and self.client.timestamp_end is None:
            self.client.timestamp_end = time.time()
            self.client.state = ConnectionState.CLOSED


class _Open:
    """One harness connection this loop serves."""

    __slots__ = ("client", "server", "reader", "writer")

    def __init__(
        self,
        client: connection.Client,
        server: connection.Server,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.client = client
        self.server = server  # the flows' `server_conn`, one per connection as in mitmproxy
        self.reader = reader
        self.writer = writer

    @property
    def gone(self) -> bool:
        return self.client.timestamp_end is not None or self.writer.is_closing()


class FrontDoor:
    """Serves the base-URL port for `addons` (their hooks, in order); `hand_over` gives a
    connection this loop does not speak to mitmproxy's reverse listener."""

    def __init__(
        self,
        addons: Sequence[object],
        mode: ProxyMode,
        target: tuple[str, str, int],
        hand_over: HandOver,
    ) -> None:
        self.mode = mode
        self.target = target
        self._hand_over = hand_over
        self._hooks = {name: _bound(addons, name) for name in _HOOKS}
        self._take: Callable[[http.HTTPFlow], ResponseAnswer | None] | None = None
        self._limit: int | None = None
        self._oversize: Callable[[http.HTTPFlow, int], None] | None = None
        self._server: asyncio.Server | None = None
        self._open: dict[str, _Open] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Where re-targeted flows go: the upstream (model lists, token counts) and the loopback.
        self.client = UpstreamPool(None)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen; the (host, port) bound. Raises OSError when the address cannot be bound."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Protocol(self), host, port, backlog=BACKLOG
        )
        bound = self._server.sockets[0].getsockname()
        return bound[0], bound[1]

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self, grace: float) -> None:
        """Close every connection still open (keep-alive), waiting `grace` for their tasks."""
        for conn in list(self._open.values()):
            conn.writer.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
        self.client.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), grace)

    def limit_bodies(self, limit: int, oversize: Callable[[http.HTTPFlow, int], None]) -> None:
        """A chunked body past `limit` bytes is read to its end but not kept, and
        `oversize(flow, size)` answers the flow instead of the `request` hook. (A body
        that announces its length is the addon's to refuse, in `requestheaders`.)"""
        self._limit, self._oversize = limit, oversize

    def answer_locally(self, take: Callable[[http.HTTPFlow], ResponseAnswer | None]) -> None:
        """`take(flow)`: the loopback's answer for a flow re-targeted at it, written here."""
        self._take = take

    # -- what conns.Connections asks of a connection this loop serves ---------------------------

    def serves(self, client_id: str) -> bool:
        return client_id in self._open

    def respond(self, client_id: str, raw: bytes) -> bool:
        """Write a complete response to a harness that has had none, then close the connection."""
        conn = self._open.get(client_id)
        if conn is None or conn.gone:
            return False
        conn.writer.write(raw)
        conn.client.state &= ~ConnectionState.CAN_WRITE
        conn.writer.close()
        return True

    def drop(self, client_id: str) -> None:
        conn = self._open.get(client_id)
        if conn is not None:
            conn.writer.close()

    # -- serving -------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        protocol = writer.transport.get_protocol()
        assert isinstance(protocol, _Protocol) and protocol.client is not None
        client = protocol.client
        client.proxy_mode = self.mode
        _, host, port = self.target
        conn = _Open(client, connection.Server(address=(host, port)), reader, writer)
        self._open[client.id] = conn
        handed = False
        try:
            while not conn.gone:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    head = b""  # too long for this loop: mitmproxy answers it
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                read = _request(head)
                if read is None:  # mitmproxy's from here on, closed at shutdown by mitmproxy
                    handed = True
                    del self._open[client.id]
                    self._tasks.discard(task)
                    unread(reader, head)
                    await self._hand_over(reader, writer)
                    return
                if not await self._exchange(conn, *read):
                    return
        except Exception as exc:  # a bug here must not take the loop's other connections
            logger.warning("the connection from %s failed: %r", client.peername, exc)
            logger.debug("traceback", exc_info=True)
        finally:
            self._tasks.discard(task)
            if not handed:
                self._open.pop(client.id, None)
                writer.close()
                protocol._mark_closed()
                await self._hook("client_disconnected", client)

    async def _exchange(
        self, conn: _Open, request: http.Request, size: int | None, close: bool
    ) -> bool:
        """One request through the hooks and back; whether the connection stays open.
        `size` is its body's (None: chunked), `close` whether it asked to close after."""
        scheme, host, port = self.target
        data = request.data  # not the properties: setting `host` would rewrite the Host header
        data.scheme, data.host, data.port = scheme.encode(), host, port
        flow_ = http.HTTPFlow(conn.client, conn.server, live=True)
        flow_.request = request
        await self._hook("requestheaders", flow_)
        if flow_.response is not None and (size is None or size > 0):
            close = True  # answered before its body was read: the connection cannot go on
        if flow_.response is None and not flow_.error:
            oversize = 0
            if not request.stream:  # a body `requestheaders` streams is read as it is sent on
                try:
                    content, oversize = await self._body(conn, size)
                except (ValueError, UpstreamError, asyncio.IncompleteReadError, ConnectionError):
                    return False  # the harness sent a broken body or left while sending it
                request.data.content = content
                request.timestamp_end = time.time()
            if oversize and self._oversize is not None:
                self._oversize(flow_, oversize)
            else:
                await self._hook("request", flow_)
        if not flow_.error and conn.gone:
            flow_.error = flow.Error(CLIENT_GONE)
        if flow_.error:  # killed by a hook, or the harness left while the hooks ran
            await self._hook("error", flow_)
            return False
        if flow_.response is not None:
            keep = await self._answer(conn, flow_)
        elif (answer := self._take(flow_) if self._take is not None else None) is not None:
            keep = await self._local(conn, flow_, answer, size)
        else:
            keep = await self._forward(conn, flow_, size)
        return keep and not close

    async def _body(self, conn: _Open, size: int | None) -> tuple[bytes, int]:
        """The request body, and 0; or, for a chunked body past the limit, nothing kept
        and its whole size."""
        if size is not None:
            return (await conn.reader.readexactly(size) if size > 0 else b""), 0
        pieces, total, limit = [], 0, self._limit
        async for piece in read_chunked(conn.reader):
            total += len(piece)
            if limit is None or total <= limit:
                pieces.append(piece)
            elif pieces:
                pieces = []  # past the limit: read to the end, counted, not kept
        if limit is not None and total > limit:
            return b"", total
        return b"".join(pieces), 0

    async def _answer(self, conn: _Open, flow_: http.HTTPFlow) -> bool:
        """A response the hooks built: written whole, as mitmproxy sends one."""
        await self._hook("responseheaders", flow_)
        await self._hook("response", flow_)
        return await self._whole(conn, flow_)

    async def _forward(self, conn: _Open, flow_: http.HTTPFlow, size: int | None) -> bool:
        """A re-targeted flow: send it on, then relay the response, streamed if asked."""
        request = flow_.request
        body = self._request_body(conn, size) if request.stream else None
        try:
            exchange = await self.client.send(request, body)
        except (UpstreamError, OSError, asyncio.IncompleteReadError) as exc:
            flow_.error = flow.Error(str(exc) or type(exc).__name__)
            await self._hook("error", flow_)
            if not conn.gone:  # no hook answered: mitmproxy's plain 502
                conn.writer.write(_bad_gateway(str(flow_.error.msg)))
            return False
        try:
            return await self._respond(
                conn, flow_, exchange.response, exchange.chunks(), exchange.size
            )
        finally:
            exchange.close()

    async def _local(
        self, conn: _Open, flow_: http.HTTPFlow, answer: ResponseAnswer, size: int | None
    ) -> bool:
        """A flow re-targeted at skycap's loopback: its answer, written here without the hop."""
        unread = (size or 0) if flow_.request.stream else 0  # a drained body is read by `open`
        try:
            opened = await answer.open(unread, conn.reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            answer.abandoned()
            flow_.error = flow.Error(CLIENT_GONE)
            await self._hook("error", flow_)
            return False
        response = messages.response_of(opened.status, opened.headers)
        pieces = opened.pieces
        try:
            return await self._respond(conn, flow_, response, pieces, None, answer.abandoned)
        finally:
            close = getattr(pieces, "aclose", None)
            if close is not None:
                await close()

    async def _respond(
        self,
        conn: _Open,
        flow_: http.HTTPFlow,
        response: http.Response,
        pieces: AsyncIterator[bytes],
        size: int | None,
        abandoned: Callable[[], None] | None = None,
    ) -> bool:
        """Relay a response whose body arrives in `pieces` (`size` bytes, None: unknown),
        streamed when `responseheaders` asks, else whole after `response`."""
        flow_.response = response
        try:
            await self._hook("responseheaders", flow_)
            if response.stream:
                return await self._relay(conn, flow_, pieces, size, abandoned)
            data = b"".join([piece async for piece in pieces])
            response.data.content = data
            response.timestamp_end = time.time()
            await self._hook("response", flow_)
            return await self._whole(conn, flow_)
        except (UpstreamError, Broken) as exc:  # the body broke off: so does the harness's
            flow_.error = flow.Error(str(exc))
            await self._hook("error", flow_)
            return False

    async def _request_body(self, conn: _Open, size: int | None) -> AsyncIterator[bytes]:
        """A body `requestheaders` asked to stream (`request.stream`), passed on as it comes."""
        if size is None:
            async for piece in read_chunked(conn.reader):
                yield chunk(piece)
            yield b"0\r\n\r\n"
            return
        left = size
        while left > 0:
            data = await conn.reader.read(min(left, _READ))
            if not data:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(data)
            yield data

    async def _whole(self, conn: _Open, flow_: http.HTTPFlow) -> bool:
        """A response whose body is all here: written in one piece, with its length."""
        response = flow_.response
        assert response is not None
        if conn.gone:
            flow_.error = flow.Error(CLIENT_GONE)
            await self._hook("error", flow_)
            return False
        fields = [(k, v) for k, v in response.headers.fields if k.lower() not in _TRANSFER]
        fields.append((b"content-length", b"%d" % len(response.raw_content or b"")))
        response.headers.fields = tuple(fields)
        conn.writer.write(http1.assemble_response(response))
        return await self._sent(conn, flow_)

    async def _relay(
        self,
        conn: _Open,
        flow_: http.HTTPFlow,
        pieces: AsyncIterator[bytes],
        size: int | None,
        abandoned: Callable[[], None] | None,
    ) -> bool:
        """A streamed response: each piece goes on as it arrives (through the hook's
        callable, when `stream` is one), then `response` with no content, as in mitmproxy."""
        response = flow_.response
        assert response is not None
        tap = response.stream if callable(response.stream) else None
        # Chunked unless the length is known and no tap can change the bytes.
        chunked = tap is not None or size is None or size < 0
        fields = [(k, v) for k, v in response.headers.fields if k.lower() not in _TRANSFER]
        if chunked:
            fields.append((b"transfer-encoding", b"chunked"))
        else:
            fields.append((b"content-length", b"%d" % size))
        response.headers.fields = tuple(fields)
        writer = conn.writer
        writer.write(http1.assemble_response_head(response))
        try:
            await _pass_on(pieces, conn, tap, chunked)
            if chunked:
                for out in _tapped(tap, b""):
                    writer.write(chunk(out))
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            if abandoned is not None:
                abandoned()
            flow_.error = flow.Error(CLIENT_GONE)
            await self._hook("error", flow_)
            return False
        response.timestamp_end = time.time()
        await self._hook("response", flow_)
        return _keep_alive(flow_)

    async def _sent(self, conn: _Open, flow_: http.HTTPFlow) -> bool:
        try:
            await conn.writer.drain()
        except ConnectionError:
            return False
        return _keep_alive(flow_)

    async def _hook(self, name: str, *args: Any) -> None:
        for method, is_async in self._hooks[name]:
            try:
                if is_async:
                    await method(*args)
                else:
                    method(*args)
            except Exception as exc:  # as mitmproxy does: an addon's error is logged, not fatal
                logger.warning("addon %s hook failed: %r", name, exc)
                logger.debug("traceback", exc_info=True)


#: Request headers this loop does not serve: a WebSocket upgrade, `Expect: 100-continue`.
_HANDED_OVER = frozenset({b"upgrade", b"expect"})


def _bound(addons: Sequence[object], name: str) -> list[tuple[Callable[..., Any], bool]]:
    hooks = []
    for addon in addons:
        method = getattr(addon, name, None)
        if method is not None:
            hooks.append((method, inspect.iscoroutinefunction(method)))
    return hooks


def _request(head: bytes) -> tuple[http.Request, int | None, bool] | None:
    """The request this loop serves with its body's size (None: chunked) and whether it
    asks to close the connection after, read in one pass over its headers; None for one
    it hands to mitmproxy (which answers a malformed head with its 400)."""
    request = request_head(head)
    if request is None:
        return None
    size: int | None = 0
    close = False
    for name, value in request.data.headers.fields:
        lowered = name.lower()
        if lowered == b"content-length":
            if not value.isdigit() or size is None:
                return None
            size = int(value)
        elif lowered == b"transfer-encoding":
            if value.strip().lower() != b"chunked":
                return None
            size = None
        elif lowered == b"connection":
            close = close or messages.says_close(value)
        elif lowered in _HANDED_OVER:
            return None
    return request, size, close


async def _pass_on(
    pieces: AsyncIterator[bytes],
    conn: _Open,
    tap: Callable[[bytes], Any] | None,
    chunked: bool,
) -> None:
    """Write each piece as it arrives, waiting for the harness only when it reads slowly."""
    writer = conn.writer
    transport = writer.transport
    async for piece in pieces:
        if tap is not None:
            for out in _tapped(tap, piece):
                writer.write(chunk(out) if chunked else out)
        elif piece:
            writer.write(chunk(piece) if chunked else piece)
        if conn.gone:
            raise ConnectionResetError(CLIENT_GONE)
        if transport.get_write_buffer_size() > _BUFFERED:
            await writer.drain()


def _tapped(tap: Callable[[bytes], Any] | None, piece: bytes) -> list[bytes]:
    if tap is None:
        return [piece] if piece else []
    out = tap(piece)
    if isinstance(out, bytes):
        return [out] if out else []
    return [b for b in out if b]


def _keep_alive(flow_: http.HTTPFlow) -> bool:
    """Whether the response leaves the connection open (the request's own wish is the
    caller's): HTTP/1.1 unless it says `connection: close`."""
    response = flow_.response
    assert response is not None
    data = response.data
    return data.http_version == b"HTTP/1.1" and not messages.asks_close(data.headers.fields)


def _bad_gateway(message: str) -> bytes:
    body = f"skycap: the upstream cannot be reached: {message}\n".encode()
    headers = ((b"content-type", b"text/plain"), (b"connection", b"close"))
    return http1.assemble_response(messages.response(502, body, headers))

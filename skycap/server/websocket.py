"""Responses calls over a WebSocket: each `response.create` message runs as one HTTPS call.

Codex opens `wss://…/v1/responses` (through the proxy) or `ws://…/t/{id}/v1/responses` (a
provider with `supports_websockets`) and sends one `response.create` message per call.
mitmproxy's WebSocket layer relays the connection between the harness and a sink on the
loopback (`WebSocketSink`, which only accepts the upgrade); the addon drops every client
message before it reaches the sink and hands it here (`ResponsesSocket`). Each message
becomes the `POST /v1/responses` it stands for, with the handshake's headers, and goes
through the same gate, retry check and call mode as one sent over HTTPS, recording
`transport: "websocket"`; what the mode answers (a reply streamed from the loopback, or a
whole answer) goes back as the events it holds, one message each, an error as the API's
`error` event. Messages are run one at a time, in order, as the API does on a connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
from mitmproxy import http
from wsproto.utilities import generate_accept_token

from skycap.dialects import Dialect
from skycap.dialects.responses_socket import (
    Continuation,
    SocketEvents,
    body_error,
    error_message,
    prewarm,
    read_message,
)
from skycap.server.flowstate import state_of
from skycap.server.harness import Harness
from skycap.server.keys import raw_header
from skycap.server.loopback import Loopback
from skycap.server.upstream import UpstreamError, UpstreamPool
from skycap.wire import BodyError

logger = logging.getLogger("skycap.server")

#: What every call that came as a WebSocket message records (docs/format.md).
TRANSPORT = {"transport": "websocket"}
#: Handshake headers that describe the upgrade or one HTTP request, not each call; the
#: retry headers go too, since one handshake carries many calls.
_NOT_PER_CALL = frozenset(
    {
        b"upgrade",
        b"connection",
        b"content-length",
        b"transfer-encoding",
        b"idempotency-key",
        b"x-stainless-retry-count",
    }
)
_READ = 1 << 16


def is_upgrade(flow: http.HTTPFlow) -> bool:
    """Whether the request asks for a WebSocket."""
    value = raw_header(flow.request.data.headers.fields, b"upgrade")
    return value is not None and value.lower() == b"websocket"


class WebSocketSink:
    """The server end of a captured WebSocket, on the loopback: it accepts the upgrade, then
    reads whatever reaches it (pings, the close) until the connection ends. No call
    message reaches it: the addon drops them and skycap answers them itself."""

    __slots__ = ()

    async def serve(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        key = b""
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"sec-websocket-key":
                key = value.strip()
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            b"sec-websocket-accept: " + generate_accept_token(key) + b"\r\n\r\n"
        )
        await writer.drain()
        while await reader.read(_READ):
            pass
        return False

    def abandoned(self) -> None:
        """Nothing waits on the sink."""


def open_socket(flow: http.HTTPFlow, loopback: Loopback) -> None:
    """Point an admitted upgrade at a new sink: mitmproxy then relays the WebSocket between
    the harness and the sink, and fires its message hooks. Only the upgrade's own headers
    go to the sink: the session copied the rest (the harness's key) for its calls first."""
    path = loopback.register(WebSocketSink())
    data = flow.request.data
    data.scheme, data.host, data.port, data.path = b"http", "127.0.0.1", loopback.port, path
    kept = (b"upgrade", b"connection", b"sec-websocket-key", b"sec-websocket-version")
    fields = [(k, v) for k, v in data.headers.fields if k.lower() in kept]
    data.headers.fields = ((b"host", b"127.0.0.1"), *fields)


def _per_call(name: bytes, value: bytes) -> bool:
    """Whether a handshake header goes on each call: not the upgrade's own (nor the beta
    flag that asks for the WebSocket mode, which an HTTPS upstream would not expect)."""
    name = name.lower()
    if name in _NOT_PER_CALL or name.startswith(b"sec-websocket-"):
        return False
    return not (name == b"openai-beta" and b"websocket" in value.lower())


class ResponsesSocket:
    """One captured WebSocket: its calls, run in order, and the connection-local state."""

    def __init__(
        self,
        flow: http.HTTPFlow,
        *,
        harness: Harness,
        loopback: Loopback,
        reader: UpstreamPool,
        trajectory_id: str,
        proxied: bool,
        dialect: Dialect,
        max_body_size: int,
        send: Callable[[bytes], None],
        drop: Callable[[], None],
    ) -> None:
        self.harness = harness
        self.loopback = loopback
        self.reader = reader
        self.trajectory_id = trajectory_id
        self.proxied = proxied
        self.dialect = dialect
        self.max_body_size = max_body_size
        self._send = send
        self._drop = drop
        self.client_conn = flow.client_conn
        request = flow.request
        self._origin = (request.scheme, request.host, request.port, request.path)
        self._headers = tuple((k, v) for k, v in request.headers.fields if _per_call(k, v))
        self.continuation = Continuation()
        self._inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self._running: Any = None  # the call mode's running call, told when the harness leaves
        self.closed = False

    def receive(self, content: bytes) -> None:
        """A client message, queued behind those still running."""
        if self.closed:
            return
        self._inbox.put_nowait(content)
        if self._worker is None:
            self._worker = asyncio.ensure_future(self._work())

    def close(self) -> None:
        """The connection ended: stop reading replies to it; calls already running go on
        (their replies are committed, marked as not seen to the end)."""
        if self.closed:
            return
        self.closed = True
        if self._running is not None:
            self._running.harness_left()
        if self._worker is not None:
            self._worker.cancel()

    def send(self, message: bytes) -> None:
        if not self.closed:
            self._send(message)

    async def _work(self) -> None:
        while True:
            content = await self._inbox.get()
            try:
                await self._message(content)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not leave the harness waiting
                logger.warning("WebSocket call of %s failed: %r", self.trajectory_id, exc)
                logger.debug("traceback", exc_info=True)
                self.send(body_error(500, f"internal error: {type(exc).__name__}: {exc}"))

    async def _message(self, content: bytes) -> None:
        if len(content) > self.max_body_size:
            self.send(
                body_error(
                    413,
                    f"the WebSocket message of {len(content)} bytes is over the limit of "
                    f"{self.max_body_size} bytes; send a smaller request or start the server "
                    "with a larger --max-body-size",
                )
            )
            return
        try:
            body = read_message(content)
        except BodyError as exc:
            self.send(body_error(400, str(exc)))
            return
        if body is None:
            logger.info("ignored a WebSocket message that is not response.create")
            return
        body = self.continuation.expand(body)
        if body.get("generate") is False:
            response_id, messages = prewarm(body)
            self.continuation.remember(response_id, body.get("input"), [])
            for message in messages:
                self.send(message)
            return
        body["stream"] = True  # a WebSocket reply is always its events
        await self._call(body)

    async def _call(self, body: dict[str, Any]) -> None:
        raw = orjson.dumps(body)
        flow = self._call_flow(raw)
        self._running = await self.harness.call(
            flow, self.trajectory_id, self.proxied, raw, self.dialect, TRANSPORT
        )
        try:
            if flow.response is not None:
                self._relay_whole(flow.response, body)
            elif flow.error is None and flow.request.port == self.loopback.port:
                await self._relay_stream(flow, body)
            else:
                self._drop()  # a sealed trajectory's call: the connection goes, as over HTTPS
        finally:
            self._running = None

    def _call_flow(self, raw: bytes) -> http.HTTPFlow:
        """The `POST /v1/responses` a message stands for, on the harness's connection."""
        scheme, host, port, path = self._origin
        now = time.time()
        headers = http.Headers([*self._headers, (b"content-type", b"application/json")])
        request = http.Request(
            host, port, b"POST", scheme.encode(), b"", path.encode(), b"HTTP/1.1",
            headers, raw, None, now, now,
        )  # fmt: skip
        flow = http.HTTPFlow(self.client_conn, None)  # type: ignore[arg-type]
        flow.request = request
        flow.live = True  # so a sealed trajectory can kill it, as it kills an HTTP call
        state_of(flow).proxied = self.proxied
        return flow

    def _relay_whole(self, response: http.Response, body: dict[str, Any]) -> None:
        """A whole answer: an error, a retry's replay, or a reply the upstream sent as JSON."""
        content = response.get_content(strict=False) or b""
        if response.status_code != 200:
            self.continuation.forget()
            self.send(error_message(response.status_code, content))
            return
        events = SocketEvents()
        if "json" in response.headers.get("content-type", ""):
            try:
                parsed = orjson.loads(content)
            except orjson.JSONDecodeError:
                parsed = None
            kind = "response.completed"
            if isinstance(parsed, dict) and parsed.get("status") == "incomplete":
                kind = "response.incomplete"
            events.feed(b"data: " + orjson.dumps({"type": kind, "response": parsed}) + b"\n\n")
        else:
            events.feed(content + b"\n\n")
        self._deliver(events, body)

    async def _relay_stream(self, flow: http.HTTPFlow, body: dict[str, Any]) -> None:
        """Read the reply the loopback serves for this call, as mitmproxy would have."""
        events = SocketEvents()
        exchange = None
        try:
            exchange = await self.reader.send(flow.request)
            async for chunk in exchange.chunks():
                events.feed(chunk)
                for message in events.take():
                    self.send(message)
        except UpstreamError as exc:
            if not events.ended:
                message = f"the reply stream broke: {exc}"
                self.send(body_error(502, message))
        finally:
            if exchange is not None:  # not kept: an idle connection would outlive the loopback
                exchange.conn.writer.close()
        self._deliver(events, body, sent=True)

    def _deliver(self, events: SocketEvents, body: dict[str, Any], sent: bool = False) -> None:
        """Send what is left and keep the response for the next call to continue."""
        if not sent:
            for message in events.take():
                self.send(message)
        if (response := events.response) is not None:
            self.continuation.remember(response.get("id"), body.get("input"), events.output())
        else:
            self.continuation.forget()

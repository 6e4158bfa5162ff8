"""Connection surgery on live flows: answer a harness connection directly, or drop it.

mitmproxy 12 offers no hook-level way to do two things text mode needs, so they live
here, in one place, on top of the proxyserver's connection handlers (or the front door's,
for a base-URL connection it serves):

* answer a harness call with skycap's own OpenAI-shaped 502 when the upstream connection
  fails or times out (mitmproxy would send its own HTML error page);
* drop a harness connection (a sealed trajectory's call, http.md §6).

It also finds the address each listener (reverse or proxy mode) actually bound.
"""

from __future__ import annotations

from typing import Any

from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.net.http import http1

from skycap.server import messages


def client_connected(conn: Any) -> bool:
    """Whether a harness's client connection is still open and writable (a reply's end
    can still reach it); false once it closed or mitmproxy marked it unwritable."""
    if conn.timestamp_end is not None:
        return False
    return bool(conn.state & ConnectionState.CAN_WRITE)


def listen_address(proxyserver: Any, mode: type) -> tuple[str, int]:
    """(host, port) the listener of proxy mode class `mode` bound; LookupError if none did."""
    for instance in proxyserver.servers:
        if isinstance(instance.mode, mode) and instance.listen_addrs:
            host, port = instance.listen_addrs[0][:2]
            return host, port
    raise LookupError(f"no {mode.__name__} listener is running")


class Connections:
    """Reaches the connection handlers of the running proxyserver addon."""

    def __init__(self) -> None:
        self._proxyserver: Any = None
        self._front: Any = None

    def attach(self, proxyserver: Any) -> None:
        self._proxyserver = proxyserver

    def attach_front_door(self, front: Any) -> None:
        """The base-URL listener (`frontdoor.FrontDoor`), which owns its own connections."""
        self._front = front

    def _front_serves(self, flow: http.HTTPFlow) -> bool:
        return self._front is not None and self._front.serves(flow.client_conn.id)

    def _transport(self, flow: http.HTTPFlow, connection: Any) -> Any:
        if self._proxyserver is None:
            return None
        handler = self._proxyserver.connections.get(flow.client_conn.id)
        if handler is None:
            return None
        return handler.transports.get(connection)

    def respond(self, flow: http.HTTPFlow, status: int, body: bytes) -> bool:
        """Write a complete JSON response to an HTTP/1 harness that has seen no response yet.

        Called from the `error` hook, before mitmproxy would send its own error page; the
        client connection is then marked unwritable so that page is never sent, and it is
        closed (`Connection: close`). Returns False when the response could not be written.
        """
        if flow.request.is_http2 or flow.request.is_http3 or flow.client_conn.tls_established:
            return False  # raw bytes would bypass the TLS layer of a proxied HTTPS call
        if not flow.client_conn.state & ConnectionState.CAN_WRITE:
            return False
        if self._front_serves(flow):
            return self._front.respond(flow.client_conn.id, _answer(status, body))
        transport = self._transport(flow, flow.client_conn)
        if transport is None or transport.writer is None or transport.writer.is_closing():
            return False
        transport.writer.write(_answer(status, body))
        flow.client_conn.state &= ~ConnectionState.CAN_WRITE
        transport.handler.cancel("skycap answered")
        return True

    def drop(self, flow: http.HTTPFlow) -> None:
        """Close the harness connection without a (further) response."""
        if self._front_serves(flow):
            self._front.drop(flow.client_conn.id)
            return
        transport = self._transport(flow, flow.client_conn)
        if transport is not None and transport.handler is not None:
            transport.handler.cancel("dropped by skycap")


def _answer(status: int, body: bytes) -> bytes:
    """A complete JSON response that closes the connection after it."""
    headers = ((b"content-type", b"application/json"), (b"connection", b"close"))
    return http1.assemble_response(messages.response(status, body, headers))

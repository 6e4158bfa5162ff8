"""skycap's own lean HTTP/1.1 client for text-mode model calls: keep-alive, pooled per origin.

A general-purpose client (httpx over httpcore) costs several times what mitmproxy's own
forwarding does per call (docs/performance.md), so model calls use this one: it writes
the request mitmproxy already holds (re-targeted by `textmode`) with mitmproxy's own
HTTP/1 assembler and parser, and reads the body as it comes, de-chunked. Every read is
bounded by `--upstream-timeout` (time without progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import certifi
from mitmproxy import http
from mitmproxy.net.http import http1

from skycap.server.messages import response_head

_LIMIT = 1 << 20  # the longest response head or chunk-size line
_READ = 1 << 16
#: Up to this size a request body is sent in one write with its head.
_JOINED = 1 << 16
_IDLE_PER_ORIGIN = 128
#: The response headers that say how its body is framed.
_FRAMING = frozenset({b"transfer-encoding", b"content-length"})
#: Pauses before connecting again after a refused or reset connect (nothing was sent);
#: after the last, the call fails with skycap's 502.
CONNECT_RETRY_DELAYS = (0.05, 0.25)
_RETRIED_CONNECT = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError)

Origin = tuple[str, str, int]


class UpstreamError(Exception):
    """The upstream could not be reached or broke off; the message says how."""


class UpstreamTimeout(UpstreamError):
    """No progress within `--upstream-timeout`."""


class UpstreamUnreachable(UpstreamError):
    """No connection could be made (after the retries): nothing of the request was sent."""


class _RefusedOrReset(UpstreamUnreachable):
    """The connect was refused or reset: worth another try, as nothing was sent."""


class _Method:
    """What `expected_http_body_size` reads of the request once a response is given."""

    __slots__ = ("method",)

    def __init__(self, method: bytes) -> None:
        self.method = method.decode("ascii", "replace")


class _Conn:
    __slots__ = ("reader", "writer", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False


class Exchange:
    """One response: its head (status, headers) and its body, read once with `chunks()`."""

    __slots__ = ("pool", "origin", "conn", "response", "size", "_complete")

    def __init__(
        self,
        pool: UpstreamPool,
        origin: Origin,
        conn: _Conn,
        response: http.Response,
        size: int | None,
    ) -> None:
        self.pool = pool
        self.origin = origin
        self.conn = conn
        self.response = response
        self.size = size  # bytes, None for chunked, -1 for "until the connection closes"
        self._complete = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (chunked encoding removed)."""
        reader, pool = self.conn.reader, self.pool
        try:
            if self.size is None:
                async for piece in read_chunked(reader, pool.read):
                    yield piece
            elif self.size < 0:
                while data := await pool.read(reader.read(_READ)):
                    yield data
            else:
                left = self.size
                while left > 0:
                    data = await pool.read(reader.read(min(left, _READ)))
                    if not data:
                        raise UpstreamError("the connection closed in the middle of the body")
                    left -= len(data)
                    yield data
        except asyncio.IncompleteReadError:
            raise UpstreamError("the connection closed in the middle of the body") from None
        except ValueError as exc:
            raise UpstreamError(f"malformed chunked body: {exc}") from None
        self._complete = self.size is None or self.size >= 0

    def close(self) -> None:
        """Return the connection to the pool if the body was read whole and it stays open."""
        if self._complete and not _closes(self.response):
            self.pool.release(self.origin, self.conn)
        else:
            self.conn.writer.close()


class UpstreamPool:
    """Idle keep-alive connections per (scheme, host, port), on the loop that uses them."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._idle: dict[Origin, list[_Conn]] = {}
        self._tls: ssl.SSLContext | None = None

    async def read(self, awaitable: object) -> bytes:
        """Await one read, bounded by the timeout."""
        if self.timeout is None:
            return await awaitable  # type: ignore[misc]
        try:
            async with asyncio.timeout(self.timeout):
                return await awaitable  # type: ignore[misc]
        except TimeoutError:
            raise UpstreamTimeout(f"timed out after {self.timeout:g} s") from None

    async def send(
        self, request: http.Request, streamed: AsyncIterator[bytes] | None = None
    ) -> Exchange:
        """Write `request`, read the response head; raise UpstreamError on failure.

        `streamed` is the body when the request holds none (read from the harness as it
        is sent on, already framed as its headers say). A reused idle connection that
        turns out to be closed is retried once on a new one (the upstream closed it while
        idle; it read nothing of this request).
        """
        origin = (request.scheme, request.host, request.port)
        method = request.data.method
        head, body = _head(request), request.data.content or b""
        while True:
            conn = await self._connect(origin)
            try:
                if len(body) <= _JOINED:  # one write, one system call
                    conn.writer.write(head + body)
                else:  # not joined to the head: no copy of a large body
                    conn.writer.write(head)
                    conn.writer.write(body)
                if streamed is not None:
                    conn.reused = False  # a body half sent cannot be sent again
                    async for piece in streamed:
                        conn.writer.write(piece)
                        await conn.writer.drain()
                answer = await self.read(conn.reader.readuntil(b"\r\n\r\n"))
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                conn.writer.close()
                if conn.reused and not isinstance(exc, asyncio.LimitOverrunError):
                    continue
                raise UpstreamError(_describe(exc)) from None
            except UpstreamError:
                conn.writer.close()
                raise
            break
        del request, body  # sent: a large body is freed now, not when the exchange ends
        try:
            response = response_head(answer)
            size = _body_size(method, response)
        except ValueError as exc:
            conn.writer.close()
            raise UpstreamError(f"malformed response: {exc}") from None
        return Exchange(self, origin, conn, response, size)

    async def _connect(self, origin: Origin) -> _Conn:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                conn.reused = True
                return conn
            conn.writer.close()
        scheme, host, port = origin
        tls = self._context() if scheme == "https" else None
        # A refused or reset connect sent nothing of the request, so trying again cannot
        # send it twice (docs/serving.md "Text mode's upstream connections").
        for delay in CONNECT_RETRY_DELAYS:
            try:
                return await self._open(host, port, tls)
            except _RefusedOrReset:
                await asyncio.sleep(delay)
        try:
            return await self._open(host, port, tls)
        except _RefusedOrReset as exc:
            tries = len(CONNECT_RETRY_DELAYS) + 1
            raise UpstreamUnreachable(f"{exc} ({tries} tries)") from None

    async def _open(self, host: str, port: int, tls: ssl.SSLContext | None) -> _Conn:
        try:
            reader, writer = await self.read(
                asyncio.open_connection(
                    host, port, ssl=tls, server_hostname=host if tls else None, limit=_LIMIT
                )
            )
        except OSError as exc:
            failed = _RefusedOrReset if isinstance(exc, _RETRIED_CONNECT) else UpstreamUnreachable
            raise failed(f"cannot connect to {host}:{port}: {_describe(exc)}") from None
        return _Conn(reader, writer)

    def release(self, origin: Origin, conn: _Conn) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) < _IDLE_PER_ORIGIN:
            idle.append(conn)
        else:
            conn.writer.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                with contextlib.suppress(Exception):
                    conn.writer.close()
        self._idle.clear()

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context(cafile=certifi.where())
        return self._tls


async def _direct(awaitable: Awaitable[bytes]) -> bytes:
    return await awaitable


async def read_chunked(
    reader: asyncio.StreamReader,
    read: Callable[[Awaitable[bytes]], Awaitable[bytes]] = _direct,
) -> AsyncIterator[bytes]:
    """A chunked body, de-chunked: each piece is the data of every chunk one read brought,
    joined (an event stream's many small chunks cost one step each, not three awaits).
    Reads go through `read` (a timeout; none by default); bytes past the body's end are put
    back. Raises UpstreamError when the connection closes mid-body, ValueError on a bad size."""
    buffer = b""
    while True:
        pieces, pos, done = _chunks(buffer)
        if pieces:
            yield b"".join(pieces)
        if done:
            unread(reader, buffer[pos:])
            return
        more = await read(reader.read(_READ))
        if not more:
            raise UpstreamError("the connection closed in the middle of the body")
        buffer = buffer[pos:] + more


def _chunks(buffer: bytes) -> tuple[list[bytes], int, bool]:
    """The complete chunks at the front of `buffer`: their data, where the rest starts,
    and whether the last chunk (and its trailers) ended the body."""
    pieces: list[bytes] = []
    pos = 0
    while True:
        end = buffer.find(b"\n", pos)
        if end < 0:
            if len(buffer) - pos > _LIMIT:
                raise ValueError(f"a chunk-size line longer than {_LIMIT} bytes")
            return pieces, pos, False
        try:  # the usual line: the size and CR (int skips the whitespace); one step each
            size = int(buffer[pos:end], 16)
        except ValueError:  # a chunk extension (`;name=value`)
            size = int(buffer[pos:end].split(b";", 1)[0].strip(), 16)
        if size == 0:
            if buffer.startswith((b"\r\n", b"\n"), end + 1):  # no trailers
                return pieces, buffer.index(b"\n", end + 1) + 1, True
            stop = buffer.find(b"\n\r\n", end)
            if stop < 0:
                if len(buffer) - end > _LIMIT:
                    raise ValueError(f"trailers longer than {_LIMIT} bytes")
                return pieces, pos, False
            return pieces, stop + 3, True
        start = end + 1
        stop = start + size
        if len(buffer) < stop + 2:
            return pieces, pos, False
        pieces.append(buffer[start:stop])
        pos = stop + 2  # the data's own CRLF


def chunk(data: bytes) -> bytes:
    """`data` framed as one chunk of a chunked body (what `read_chunked` undoes)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def unread(reader: asyncio.StreamReader, data: bytes) -> None:
    """Put `data` back at the front of what `reader` has not returned yet. asyncio's
    StreamReader has no unread; its buffer is a bytearray it reads from the front."""
    if data:
        buffer: bytearray = reader._buffer  # type: ignore[attr-defined]
        buffer[:0] = data


def _body_size(method: bytes, response: http.Response) -> int | None:
    """A response body's size as mitmproxy's `expected_http_body_size` gives it (None:
    chunked, -1: until the connection closes; ValueError when malformed). Read here in
    one pass for the usual head, a single `transfer-encoding: chunked` or
    `content-length`; any other head goes to mitmproxy's own rules."""
    data = response.data
    if method.upper() != b"HEAD" and data.status_code >= 200 and data.status_code not in (204, 304):
        framing = [(n, v) for k, v in data.headers.fields if (n := k.lower()) in _FRAMING]
        if len(framing) == 1:
            name, value = framing[0]
            if name == b"transfer-encoding" and value.lower() == b"chunked":
                return None
            if name == b"content-length" and value.isdigit():
                return int(value)
    return http1.expected_http_body_size(_Method(method), response)


def _closes(response: http.Response) -> bool:
    """Whether the connection closes after `response` (mitmproxy's `connection_close`),
    read in one pass for an HTTP/1.1 head without a `connection` header."""
    data = response.data
    if data.http_version == b"HTTP/1.1" and all(
        k.lower() != b"connection" for k, _ in data.headers.fields
    ):
        return False
    return http1.connection_close(data.http_version, response.headers)


def _head(request: http.Request) -> bytes:
    """The request line and headers as HTTP/1.1, whatever version the harness spoke."""
    data = request.data
    fields = data.headers.fields
    lines = [data.method + b" " + data.path + b" HTTP/1.1"]
    if not any(k.lower() == b"host" for k, _ in fields):
        lines.append(b"host: " + (request.host_header or request.host).encode("idna"))
    lines += [k + b": " + v for k, v in fields]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the upstream closed the connection before answering"
    if isinstance(exc, asyncio.LimitOverrunError):
        return "the response head is too large"
    return str(exc) or type(exc).__name__

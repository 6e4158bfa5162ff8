"""Text mode (http.md §7): forward harness calls through mitmproxy itself and tap the replies.

A chat call is re-targeted to the upstream in the `request` hook with the raw body
unchanged; a call through the proxy listener with no `--upstream-url` keeps its original
host (D-8). A non-streamed reply is committed in the `response` hook, before mitmproxy
sends it on. A streamed reply is relayed chunk by chunk through a `flow.response.stream`
callable that feeds the SSE assembler and holds chunks back from the first one carrying a
`finish_reason`; at `[DONE]` or the end of the body it commits, then releases them, so a
`finish` sent after the stream always finds the reply. Upstream failures are recorded on
the trajectory; a broken stream leaves the harness with a failed, not a short, stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Iterable
from typing import Any

import orjson
from mitmproxy import http

from skycap.dialects import Dialect, Request
from skycap.dialects.sse import StreamError
from skycap.server.conns import Connections
from skycap.server.options import ServerOptions
from skycap.server.retry import Entry, Replay
from skycap.server.store import Live, TrajectoryStore
from skycap.text.commit import commit_text_call

logger = logging.getLogger("skycap.server")

# http.md §7.1: headers the harness sent that never reach the model server as they were.
_DROPPED = frozenset(
    {
        b"authorization",
        b"x-api-key",
        b"proxy-authorization",
        b"host",
        b"content-length",
        b"transfer-encoding",
        b"connection",
    }
)
_DROPPED_KEEP_HOST = _DROPPED - {b"host"}
#: Set on a flow whose harness asked for `Connection: close`: its answer says so and the
#: connection closes after it (the header itself is hop-by-hop and not forwarded).
CLOSE_AFTER = "skycap.close_after"
_EVENT_STREAM = "text/event-stream"
ANTHROPIC_HOST = "api.anthropic.com"


class TextMode:
    """Where text-mode calls go and how they are forwarded (one per server)."""

    def __init__(self, options: ServerOptions, store: TrajectoryStore, conns: Connections) -> None:
        self.store = store
        self.conns = conns
        self._key = options.api_key.encode() if options.api_key else None
        self._auth_style = options.upstream_auth
        self.has_upstream = bool(options.upstream_url)
        if self.has_upstream:
            scheme, host, port = options.upstream_origin
            self._scheme = scheme.encode("ascii")
            self._host = host
            self._port = port
            default_port = 443 if scheme == "https" else 80
            authority = host if ":" not in host else f"[{host}]"
            host_header = authority if port == default_port else f"{authority}:{port}"
            self._base = options.upstream_path.encode()
            self._added = ((b"host", host_header.encode()), *self._auth(host))
        self.timeout = options.upstream_timeout

    def forward(self, flow: http.HTTPFlow, suffix: bytes) -> None:
        """Send the flow on with the header rules of http.md §7.1.

        With an upstream URL, to `{upstream base}{suffix}`; without one (a call through
        the proxy listener, D-8), to the host, port and path the harness asked for.
        """
        data = flow.request.data
        if self.has_upstream:
            data.scheme = self._scheme
            data.host = self._host
            data.port = self._port
            data.path = self._base + suffix
            dropped, added = _DROPPED, self._added
        else:
            dropped, added = _DROPPED_KEEP_HOST, self._auth(flow.request.host)
        if any(
            k.lower() == b"connection" and b"close" in v.lower() for k, v in data.headers.fields
        ):
            flow.metadata[CLOSE_AFTER] = True
        kept = tuple(f for f in data.headers.fields if f[0].lower() not in dropped)
        body = data.content
        length = ((b"content-length", b"%d" % len(body)),) if body else ()
        data.headers.fields = kept + added + length

    def _auth(self, host: str) -> tuple[tuple[bytes, bytes], ...]:
        """The upstream key's header for `host` (D-37): `x-api-key` for api.anthropic.com or
        with `--upstream-auth x-api-key`, else a Bearer token (all vLLM's auth reads)."""
        if self._key is None:
            return ()
        style = self._auth_style or ("x-api-key" if host == ANTHROPIC_HOST else "bearer")
        if style == "x-api-key":
            return ((b"x-api-key", self._key),)
        return ((b"authorization", b"Bearer " + self._key),)

    def on_forward_error(self, flow: http.HTTPFlow, dialect: Dialect) -> None:
        """A forwarded model list or token count failed before any reply: skycap's 502."""
        if flow.response is None and flow.error and not flow.error.msg.startswith("Client"):
            message = f"upstream unavailable: {flow.error.msg}"
            self.conns.respond(flow, 502, dialect.error(502, message))

    def start_call(
        self, flow: http.HTTPFlow, live: Live, request: Request, entry: Entry, dialect: Dialect
    ) -> TextCall:
        call = TextCall(self, flow, live, request, entry, dialect)
        self.forward(flow, dialect.upstream_path)
        return call


class TextCall:
    """One forwarded model call: its timing, its stream tap and its outcome (exactly once).

    The flow holds the call (its metadata, its response's stream tap); the call holds the
    flow only weakly, so no reference cycle keeps a large request alive after the call
    until the garbage collector runs. Once the call is over it drops the parsed body too
    (a cancelled timer may keep the call itself alive until its deadline).
    """

    __slots__ = (
        "mode",
        "_flow",
        "live",
        "request",
        "entry",
        "dialect",
        "t_start",
        "assembler",
        "held",
        "over",
        "relaying",
        "deadline",
        "loop",
        "timer",
        "timed_out",
        "cancelled",
    )

    def __init__(
        self,
        mode: TextMode,
        flow: http.HTTPFlow,
        live: Live,
        request: Request,
        entry: Entry,
        dialect: Dialect,
    ) -> None:
        self.mode = mode
        self._flow = weakref.ref(flow)
        self.live = live
        self.request: Request | None = request
        self.entry = entry
        self.dialect = dialect
        self.t_start = time.time()
        self.assembler: Any = None
        self.held: list[bytes] = []
        self.over = False
        self.relaying = False
        self.timed_out = False
        self.cancelled = False
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = 0.0
        self.loop = asyncio.get_running_loop()
        live.inflight[self] = self.cancel
        live.touch()
        if mode.timeout is not None:
            self.deadline = self.loop.time() + mode.timeout
            self.timer = self.loop.call_at(self.deadline, self._check_timeout)

    # -- timeout (D-11: time without progress) ---------------------------------------------

    def _progress(self) -> None:
        if self.timer is not None:
            self.deadline = self.loop.time() + self.mode.timeout

    def _check_timeout(self) -> None:
        """Fires at the first deadline; re-arms while chunks keep moving it (one timer per call)."""
        if self.over:
            return
        if self.loop.time() < self.deadline:
            self.timer = self.loop.call_at(self.deadline, self._check_timeout)
            return
        self.timed_out = True
        flow = self._flow()
        if flow is not None:
            self.mode.conns.abort_upstream(flow)

    # -- outcome -----------------------------------------------------------------------------

    def _end(self, replay: Replay | None = None) -> None:
        """Settle the retry entry and leave the in-flight set; every path ends here once."""
        self.over = True
        if self.timer is not None:
            self.timer.cancel()
        self.entry.settle(replay)
        self.live.inflight.pop(self, None)
        self.live.touch()
        self.request = None  # the parsed body may be large: free it with the call (issue 17)

    def cancel(self) -> None:
        """The trajectory was sealed: commit nothing, drop the harness connection (§6)."""
        self.cancelled = True
        self._end()
        flow = self._flow()
        if flow is not None:
            self.mode.conns.drop(flow)

    def _fail(self, status: int | None, error: str) -> None:
        self.mode.store.note_failure(self.live, status, error)

    def _commit(self, reply: dict[str, Any], finish_reason: Any, usage: Any) -> bool:
        call = {
            "t_start": self.t_start,
            "t_end": time.time(),
            "model": self.request.model,
            "sampling": self.request.sampling,
            "usage": usage if isinstance(usage, dict) else None,
            "finish_reason": finish_reason if isinstance(finish_reason, str) else None,
            "dialect": self.dialect.name,
        }
        try:
            node = commit_text_call(self.live.trajectory, self.request, reply, call)
        except Exception as exc:  # a reply that cannot be hashed is a failure, not a crash
            logger.warning("committing a reply of %s failed: %r", self.live.id, exc)
            self._fail(None, f"unreadable reply: {type(exc).__name__}: {exc}")
            return False
        if node is None:
            return False
        self.mode.store.note_commit(self.live, call)
        return True

    # -- non-streamed replies (http.md §7.2) ---------------------------------------------------

    def on_response(self, response: http.Response) -> None:
        """The whole reply is here and not yet sent on: commit it or record why not."""
        if self.over or self.relaying:
            return
        status = response.status_code
        if status != 200:
            self._fail(status, _text(response))
            self._end()
            return
        try:
            message, finish_reason, usage = self.dialect.reply_message(_read_reply(response))
        except ValueError as problem:
            self._fail(None, f"unreadable reply: {problem}")
            self._end()
            return
        committed = self._commit(message, finish_reason, usage)
        replay = None
        if committed:
            replay = Replay.of(status, response.headers.fields, response.raw_content or b"")
        self._end(replay)

    # -- streamed replies (http.md §7.3) --------------------------------------------------------

    def on_response_headers(self, response: http.Response) -> None:
        if self.over:
            return
        self._progress()
        if (
            self.request.stream
            and response.status_code == 200
            and response.headers.get("content-type", "").startswith(_EVENT_STREAM)
        ):
            self.assembler = self.dialect.assembler()
            self.relaying = True
            if response.headers.get("cache-control") != "no-cache":
                response.headers["cache-control"] = "no-cache"
            response.stream = self.relay

    def relay(self, chunk: bytes) -> bytes | Iterable[bytes]:
        """mitmproxy's stream callable: pass chunks on, hold back the tail, commit, release.

        "Nothing to send" is `[]`, never `b""`: mitmproxy would write an empty chunk, which
        in chunked encoding is the terminator.
        """
        if self.over:
            return []
        assembler = self.assembler
        assert assembler is not None
        if chunk:
            self._progress()
            assembler.feed(chunk)
            if not assembler.finish_seen:
                return chunk
            self.held.append(chunk)
            if not assembler.done:
                return []
        return self._complete()

    def _complete(self) -> list[bytes]:
        """[DONE] or the end of the body: commit (or record why not), then release the tail."""
        assert self.assembler is not None
        try:
            message, finish_reason = self.assembler.result()
        except StreamError as exc:
            self._fail(None, str(exc))
        else:
            self._commit(message, finish_reason, self.assembler.usage)
        self._end()
        held, self.held = self.held, []
        return held

    # -- failures before or during the reply --------------------------------------------------

    def on_error(self, flow: http.HTTPFlow) -> None:
        """mitmproxy gave up on the flow: the harness left, we cancelled, or the upstream failed."""
        if self.over:
            return
        message = flow.error.msg if flow.error else "unknown error"
        if _client_gone(flow) and not self.timed_out:
            self._end()
            return
        if self.timed_out:
            detail = f"timed out after {self.mode.timeout:g} s"
            error = f"upstream: {detail}"
        elif self.relaying:
            detail = message
            error = f"upstream stream interrupted: {message}"
        else:
            detail = message
            error = f"upstream: {message}"
        self._fail(None, error)
        self._end()
        if not self.relaying:
            # Once relaying, mitmproxy itself drops the harness connection mid-stream.
            body = self.dialect.error(502, f"upstream unavailable: {detail}")
            self.mode.conns.respond(flow, 502, body)


def _client_gone(flow: http.HTTPFlow) -> bool:
    return bool(flow.error and flow.error.msg.startswith("Client disconnected"))


def _text(response: http.Response) -> str:
    content = response.get_content(strict=False) or b""
    return content[:8000].decode("utf-8", "replace")


def _read_reply(response: http.Response) -> dict[str, Any]:
    """The reply body as a JSON object; a ValueError says why it is not one."""
    try:
        content = response.get_content(strict=True) or b""
    except ValueError as exc:
        raise ValueError(f"the body cannot be decoded: {exc}") from None
    try:
        parsed = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"the body is not JSON ({exc}): {content[:200]!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"the body is not a JSON object: {content[:200]!r}")
    return parsed

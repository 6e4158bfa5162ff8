"""Text mode (http.md §3.1): forward harness calls upstream and tap the replies.

Model calls (chat, Messages, Responses) go upstream with skycap's own pooled client
(`upstream.py`) on a task of their own, with the raw body unchanged (but for the one
member `--upstream-weight-versions` adds), so a harness that
disconnects does not cancel them: the reply is read to its end and committed,
marked `harness_saw_end: false`, and settles the retry entry replayable. A non-streamed
reply is committed before the harness gets it; a streamed one reaches the harness through
the loopback (`loopback.UpstreamRelay`), holding back the tail from the first chunk that
ends the reply until it is committed, so a `finish` sent after the stream always finds it. Model
lists and token counts are still forwarded by mitmproxy itself (`forward`). Upstream
failures are recorded on the trajectory; a broken stream leaves the harness with a
failed, not a short, stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

import orjson
from mitmproxy import http

from skycap.calls import call_record, harness_mark, reply_id_mark
from skycap.dialects import Dialect, Request
from skycap.dialects.sse import StreamError
from skycap.episodes import FailureEpisode
from skycap.server import messages
from skycap.server.conns import Connections, client_connected
from skycap.server.flowstate import state_of
from skycap.server.keys import raw_header
from skycap.server.live import Live
from skycap.server.loopback import Loopback, UpstreamRelay
from skycap.server.options import ServerOptions
from skycap.server.retry import CallKey, Entry, Replay
from skycap.server.store import TrajectoryStore
from skycap.server.upstream import Exchange, UpstreamError, UpstreamPool, UpstreamUnreachable
from skycap.text.commit import commit_text_call
from skycap.tokens.provenance import versions
from skycap.weights import Span, reported_spans

logger = logging.getLogger("skycap.server")

# http.md §3.1: headers the harness sent that never reach the model server as they were.
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
_EVENT_STREAM = b"text/event-stream"
ANTHROPIC_HOST = "api.anthropic.com"
#: Response headers that describe one transfer, not the reply: rebuilt for the harness.
_TRANSFER = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})


NO_UPSTREAM = (
    "no --upstream-url configured: this server forwards only calls made through its proxy "
    "port; start it with --upstream-url to take /t/{id}/v1 calls"
)


class TextMode:
    """The `CallMode` of a text-mode server: where calls go and how they are forwarded."""

    capture: dict[str, Any] = {"mode": "text"}
    release = None
    decode_spans = None
    counters = None
    renders = False

    def __init__(self, options: ServerOptions, conns: Connections, loopback: Loopback) -> None:
        self.store: TrajectoryStore = None  # type: ignore[assignment]  # set by attach
        self.conns = conns
        self.loopback = loopback
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
        self.ask_weight_versions = options.upstream_weight_versions
        self.timeout = options.upstream_timeout
        self.client = UpstreamPool(self.timeout)
        # An upstream that is down fails every call: one episode, not a line per call.
        self.unreachable = FailureEpisode(
            logger, "the upstream cannot be reached (calls are answered 502)"
        )
        self.tasks: set[asyncio.Task[None]] = set()  # calls still running, for close()

    def forward(self, flow: http.HTTPFlow, suffix: bytes) -> None:
        """Send the flow on with the header rules of http.md §3.1.

        With an upstream URL, to `{upstream base}{suffix}`; without one (a call through
        the proxy listener), to the host, port and path the harness asked for.
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
        if messages.asks_close(data.headers.fields):
            state_of(flow).close_after = True  # the answer says so; the connection then closes
        kept = tuple(f for f in data.headers.fields if f[0].lower() not in dropped)
        body = data.content
        length = ((b"content-length", b"%d" % len(body)),) if body else ()
        data.headers.fields = kept + added + length

    def _auth(self, host: str) -> tuple[tuple[bytes, bytes], ...]:
        """The upstream key's header for `host`: `x-api-key` for api.anthropic.com or
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

    def provenance(self) -> dict[str, Any]:
        """Text mode renders nothing itself: skycap's version is all it can vouch for."""
        return {"skycap": versions()["skycap"]}

    def attach(self, store: TrajectoryStore) -> None:
        self.store = store
        store.episodes["upstream_connect"] = self.unreachable

    def describe(self) -> None:
        return None  # the start line already names the upstream

    def refusal(self, proxied: bool) -> str | None:
        """Without an upstream URL only calls through the proxy listener can be forwarded."""
        return None if self.has_upstream or proxied else NO_UPSTREAM

    async def models(
        self, flow: http.HTTPFlow, live: Live, suffix: bytes, dialect: Dialect
    ) -> None:
        self.forward(flow, suffix)

    async def count_tokens(
        self, flow: http.HTTPFlow, live: Live, request: Request, suffix: bytes, dialect: Dialect
    ) -> None:
        self.forward(flow, suffix)

    async def stored_reply(
        self, flow: http.HTTPFlow, live: Live, reply_id: str, suffix: bytes, dialect: Dialect
    ) -> None:
        self.forward(flow, suffix)

    def join_running(
        self, flow: http.HTTPFlow, live: Live, key: CallKey, request: Request, dialect: Dialect
    ) -> bool:
        """A retry of a call still running waits for its original in the retry cache."""
        return False

    def harness_left(self, flow: http.HTTPFlow, forwarded: bool, dialect: Dialect) -> None:
        if forwarded:
            self.on_forward_error(flow, dialect)

    # -- model calls: skycap's own client (a disconnect does not cancel them) ----------------

    async def start(self) -> None:
        """Nothing to start: the loopback is the addon's."""

    async def close(self) -> None:
        """After the store's shutdown: end the calls still running, then the connections."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.client.close()

    async def call(
        self, flow: http.HTTPFlow, live: Live, request: Request, entry: Entry, dialect: Dialect
    ) -> TextCall:
        """Run one model call as skycap's own task; return once the harness can be answered.

        The flow is then answered (a complete reply or skycap's error), re-targeted to the
        loopback (a streamed reply, still arriving), or dropped (the trajectory was sealed).
        """
        member = dialect.weight_versions_request
        if self.ask_weight_versions and member is not None:
            data = flow.request.data
            data.content = with_member(data.content or b"", member)
        self.forward(flow, dialect.upstream_path)
        call = TextCall(self, flow, live, request, entry, dialect)
        await call.wait_ready()
        return call


class TextCall:
    """One model call on skycap's own task: its upstream exchange, stream tap and outcome.

    The task outlives the harness: a reply is read to its end and committed whether or not
    anyone still waits for it, so a retry finds it in the retry cache. Only sealing the
    trajectory (`cancel`), `--upstream-timeout` and shutdown stop it. The flow holds the
    call (its metadata); the call holds the flow only weakly, so no reference cycle keeps
    a large request alive after the call until the garbage collector runs.
    """

    __slots__ = (
        "mode",
        "_flow",
        "client_conn",
        "relay_path",
        "live",
        "trajectory_id",
        "request",
        "entry",
        "dialect",
        "t_start",
        "ready",
        "task",
        "stream",
        "assembler",
        "held",
        "body",
        "over",
        "gone",
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
        self.client_conn = flow.client_conn
        self.relay_path = b""
        self.live = live
        self.trajectory_id = live.id
        self.request: Request | None = request
        self.entry = entry
        self.dialect = dialect
        self.t_start = time.time()
        loop = asyncio.get_running_loop()
        #: What the harness's flow does next: an answer, a relay, or None (drop it).
        self.ready: asyncio.Future[http.Response | UpstreamRelay | None] = loop.create_future()
        self.stream: UpstreamRelay | None = None
        self.assembler: Any = None
        self.held: list[bytes] = []
        self.body: list[bytes] = []
        self.over = False
        self.gone = False
        live.inflight[self] = self.cancel
        live.touch()
        self.task = asyncio.ensure_future(self._run(flow.request))
        mode.tasks.add(self.task)
        self.task.add_done_callback(mode.tasks.discard)

    @property
    def relaying(self) -> bool:
        return self.stream is not None

    async def wait_ready(self) -> None:
        """Apply the call's first outcome to the flow (from the `request` hook)."""
        try:
            outcome = await asyncio.shield(self.ready)
        except asyncio.CancelledError:
            if not self.ready.cancelled():
                self.gone = True  # the hook itself was cancelled: the task goes on
                raise
            outcome = None
        flow = self._flow()
        if flow is None:
            return
        if outcome is None:
            if flow.killable:
                flow.kill()
        elif isinstance(outcome, UpstreamRelay):
            self.relay_path = self.mode.loopback.retarget(flow, outcome)
        else:
            flow.response = outcome

    def harness_left(self) -> None:
        """mitmproxy gave up on the flow (the harness disconnected): stop relaying to it."""
        if not self.gone:
            self.gone = True
            if self.stream is not None:
                self.mode.loopback.forget(self.relay_path)

    # -- outcome -----------------------------------------------------------------------------

    def _end(self, replay: Replay | None = None) -> None:
        """Settle the retry entry and leave the in-flight set; every path ends here once."""
        self.over = True
        self.entry.settle(replay)
        self.live.inflight.pop(self, None)
        self.live.touch()
        self.request = None  # type: ignore[assignment]  # the parsed body can be large
        self.body = []
        self.assembler = None
        self.live = None  # type: ignore[assignment]  # nor keep the trajectory once over

    def cancel(self) -> None:
        """The trajectory was sealed: commit nothing, drop the harness connection (http.md §6)."""
        if self.over:
            return
        self._end()
        self.task.cancel()
        if not self.ready.done():
            self.ready.set_result(None)
        elif self.stream is not None:
            self.stream.put(UpstreamRelay.BROKEN)
        elif (flow := self._flow()) is not None:
            self.mode.conns.drop(flow)

    def _answer(self, response: http.Response | UpstreamRelay | None) -> None:
        if not self.ready.done():
            self.ready.set_result(response)

    def _fail(self, status: int | None, error: str) -> None:
        self.mode.store.note_failure(self.live, status, error)

    def _harness_saw_end(self) -> bool:
        """Whether the harness is still there to receive the reply's end."""
        return not self.gone and client_connected(self.client_conn)

    def _commit(
        self,
        reply: dict[str, Any],
        finish_reason: Any,
        usage: Any,
        saw_end: bool,
        reply_id: Any = None,
        weight_versions: list[Span] | None = None,
    ) -> bool:
        call = call_record(
            self.request,
            self.dialect,
            t_start=self.t_start,
            model=self.request.model,
            sampling=self.request.sampling,
            usage=usage if isinstance(usage, dict) else None,
            finish_reason=finish_reason if isinstance(finish_reason, str) else None,
            measured=None if weight_versions is None else {"weight_versions": weight_versions},
            # the upstream's reply id, which later calls may name
            marks={**harness_mark(saw_end), **reply_id_mark(self.dialect, reply_id)},
        )
        try:
            live = self.live
            node = commit_text_call(live.trajectory, self.request, reply, call, live.hashes)
        except Exception as exc:  # a reply that cannot be hashed is a failure, not a crash
            logger.warning("committing a reply of %s failed: %r", self.live.id, exc)
            self._fail(None, f"unreadable reply: {type(exc).__name__}: {exc}")
            return False
        if node is None:
            return False
        self.mode.store.note_commit(self.live, call)
        return True

    # -- the exchange ----------------------------------------------------------------------------

    async def _run(self, request: http.Request) -> None:
        exchange: Exchange | None = None
        try:
            exchange = await self.mode.client.send(request)
            del request  # written: the flow may go
            self.mode.unreachable.succeeded()
            head = exchange.response
            content_type = raw_header(head.headers.fields, b"content-type") or b""
            if (
                self.request.stream
                and head.status_code == 200
                and content_type.startswith(_EVENT_STREAM)
            ):
                await self._relay_upstream(exchange)
            else:
                body = b"".join([chunk async for chunk in exchange.chunks()])
                self._complete_reply(head, body)
        except asyncio.CancelledError:
            if not self.over:  # not sealed: shutdown stopped the loop's tasks
                self._fail(None, "upstream: the server shut down during the call")
                self._end()
                self._answer(None)
        except UpstreamError as exc:
            if isinstance(exc, UpstreamUnreachable):
                self.mode.unreachable.failed(self.trajectory_id, str(exc))
            self._upstream_failed(str(exc))
        except Exception as exc:  # a bug must not leave the harness hanging
            logger.warning("text-mode call of %s failed: %r", self.trajectory_id, exc)
            self._upstream_failed(f"{type(exc).__name__}: {exc}")
        finally:
            if exchange is not None:
                exchange.close()

    def _upstream_failed(self, detail: str) -> None:
        if self.over:
            return
        if self.stream is not None:
            error = f"upstream stream interrupted: {detail}"
            # A failed, not a short, stream: the dialect's error event ends it.
            failure = self.dialect.stream_failure(self.assembler, error)
            self._fail(None, error)
            self._end()
            self._send(failure)
            self.stream.put(UpstreamRelay.END)
            return
        self._fail(None, f"upstream: {detail}")
        self._end()
        body = self.dialect.error(502, f"upstream unavailable: {detail}")
        self._answer(messages.response(502, body, messages.JSON))

    # -- non-streamed replies (http.md §3.1) ---------------------------------------------------

    def _complete_reply(self, response: http.Response, body: bytes) -> None:
        """The whole reply is here and not yet sent on: commit it or record why not."""
        fields = [f for f in response.headers.fields if f[0].lower() not in _TRANSFER]
        fields.append((b"content-length", b"%d" % len(body)))
        response.headers.fields = tuple(fields)
        response.raw_content = body
        response.timestamp_start = response.timestamp_end = time.time()
        if self.over:
            return
        status = response.status_code
        replay = None
        if status != 200:
            self._fail(status, _text(response))
        else:
            try:
                parsed = _read_reply(response)
                message, finish_reason, usage = self.dialect.reply_message(parsed)
            except ValueError as problem:
                self._fail(None, f"unreadable reply: {problem}")
            else:
                saw_end = self._harness_saw_end()
                spans = reported_spans(parsed)
                if self._commit(message, finish_reason, usage, saw_end, parsed.get("id"), spans):
                    replay = Replay.of(status, fields, body)
        self._end(replay)
        self._answer(response)

    # -- streamed replies (http.md §3.1) --------------------------------------------------------

    async def _relay_upstream(self, exchange: Exchange) -> None:
        """Pass chunks on, hold back the tail from the first `finish_reason`, commit, release.

        The harness's flow is re-targeted to the loopback as soon as the headers are here;
        the body is read to its end even when the harness has gone.
        """
        fields = [f for f in exchange.response.headers.fields if f[0].lower() != b"cache-control"]
        fields.append((b"cache-control", b"no-cache"))
        self.stream = UpstreamRelay(200, fields)
        self._answer(self.stream)
        assembler = self.assembler = self.dialect.assembler()
        chunks = exchange.chunks()
        async for chunk in chunks:
            if self.over:
                return
            if not chunk:
                continue
            self.body.append(chunk)
            assembler.feed(chunk)
            if not assembler.finish_seen:
                self._send(chunk)
                continue
            self.held.append(chunk)
            if assembler.done:
                self._complete_stream(assembler, fields)
                async for _ in chunks:  # whatever follows [DONE]; the connection is then reused
                    pass
                return
        self._complete_stream(assembler, fields)

    def _send(self, chunk: bytes) -> None:
        if not self.gone and self.stream is not None:
            self.stream.put(chunk)

    def _complete_stream(self, assembler: Any, fields: list[tuple[bytes, bytes]]) -> None:
        """[DONE] or the end of the body: commit (or record why not), then release the tail.

        A stream the harness read to its end is not replayable (its retry samples
        again); one whose harness went away is, as the SSE it was.
        """
        if self.over:
            return
        saw_end = self._harness_saw_end()
        replay = None
        failure = b""
        try:
            message, finish_reason = assembler.result()
        except StreamError as exc:
            self._fail(None, str(exc))
            if not assembler.done:  # cut short, not ended by the upstream's own error event
                failure = self.dialect.stream_failure(assembler, str(exc))
        else:
            reply_id = getattr(assembler, "reply_id", None)
            committed = self._commit(
                message,
                finish_reason,
                assembler.usage,
                saw_end,
                reply_id,
                assembler.weight_versions,
            )
            if committed and not saw_end:
                replay = Replay.of(200, fields, b"".join(self.body))
        self.body = []
        self._end(replay)
        for chunk in self.held:
            self._send(chunk)
        self.held = []
        if failure:
            self._send(failure)
        assert self.stream is not None
        self.stream.put(UpstreamRelay.END)


def with_member(body: bytes, member: bytes) -> bytes:
    """`body`, a JSON object, with `member` ("name":value) added as its first member.

    Spliced, not re-serialised, so the rest of the harness's bytes go upstream as sent; a
    name the harness set itself comes later and, as JSON parsers keep the last of a
    repeated name, its value wins.
    """
    opening = body.index(b"{") + 1  # only whitespace may come before an object
    empty = body[opening:].lstrip()[:1] == b"}"
    return body[:opening] + member + (b"" if empty else b",") + body[opening:]


def _text(response: http.Response) -> str:
    content = response.get_content(strict=False) or b""
    return content[:8000].decode("utf-8", "replace")


def _read_reply(response: http.Response) -> dict[str, Any]:
    """The reply body as a JSON object; a ValueError says why it is not one."""
    if raw_header(response.headers.fields, b"content-encoding") is None:
        content = response.raw_content or b""  # as get_content gives a body with no encoding
    else:
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

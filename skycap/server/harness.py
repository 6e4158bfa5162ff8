"""The harness routes of http.md §3: admit a call, check its body, de-duplicate retries, run it.

The addon hands a model call (with its dialect, skycap.dialects) or a model-list call
here once its body is read and within `--max-body-size`, whether it came as
`/t/{id}/v1/...` or through the proxy listener. Text mode then forwards it with
skycap's own client (`textmode`); token mode answers it from the token backend. Either
way the call runs as its own task, so a client disconnect does not cancel it (http.md §5);
the backend is told, at the commit, whether the harness is still there. A streamed
token-mode retry of a call still running is answered from the stream sink at once, with
keep-alives until the original's reply is there to send.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson
from mitmproxy import http

from skycap.dialects import Dialect, Request, StreamWriter
from skycap.dialects.chat import DIALECT as CHAT
from skycap.dialects.messages import DIALECT as MESSAGES
from skycap.dialects.messages import models_listing
from skycap.dialects.responses import DIALECT as RESPONSES
from skycap.server.conns import client_connected
from skycap.server.keys import authorized, bearer_key, key_matches, raw_header
from skycap.server.live import Live
from skycap.server.options import ServerOptions
from skycap.server.responses import UnknownResponse, place
from skycap.server.retry import CallKey, Conflict, Entry, Found, Replay, call_key
from skycap.server.store import SHUTTING_DOWN, UNKNOWN, TrajectoryStore
from skycap.server.stream_sink import StreamSink
from skycap.server.textmode import TextCall, TextMode
from skycap.tokens.relay import error_event, waiting_writer
from skycap.tokens.streaming import ReplyStream
from skycap.trajectory import is_trajectory_id
from skycap.wire import BodyError, parse_json_body

logger = logging.getLogger("skycap.server")

#: Set on a flow answered from the stream sink: its response passes through unbuffered.
STREAMED = "skycap.streamed"
#: Set on a token-mode flow mitmproxy gave up on (the harness left it).
HARNESS_LEFT = "skycap.harness_left"

_JSON = ((b"content-type", b"application/json"),)
NO_UPSTREAM = (
    "no --upstream-url configured: this server forwards only calls made through its proxy "
    "port; start it with --upstream-url to take /t/{id}/v1 calls"
)


def respond(flow: http.HTTPFlow, status: int, body: bytes, headers: Any = _JSON) -> None:
    """Answer from a request hook; mitmproxy then contacts no upstream for this flow."""
    flow.response = http.Response.make(status, body, headers)


def harness_error(
    flow: http.HTTPFlow,
    status: int,
    message: str,
    code: str | None = None,
    dialect: Dialect = CHAT,
    param: str | None = None,
) -> None:
    """Answer with the error body the caller's SDK reads, in its dialect (http.md §1)."""
    respond(flow, status, dialect.error(status, message, code, param))


class Harness:
    """Admits harness calls into one store and runs them in the server's mode (one per server).

    `text` is the text-mode forwarder, None in token mode, where `backend` answers.
    """

    def __init__(
        self,
        options: ServerOptions,
        store: TrajectoryStore,
        text: TextMode | None,
        backend: Any,
    ) -> None:
        self.require_api_key = options.require_api_key
        self.store = store
        self.text = text
        self.backend = backend
        self.keepalive = options.keepalive
        #: Where streamed token-mode replies are served from (None in text mode).
        self.streams = StreamSink() if text is None else None
        #: Streamed retries waiting on their original (held so they are not collected).
        self._waiting: set[asyncio.Future[None]] = set()

    async def models(
        self, flow: http.HTTPFlow, trajectory_id: str, proxied: bool, dialect: Dialect
    ) -> None:
        """The model list: the upstream's, forwarded (text), or the backend's (tokens).

        Token mode answers an Anthropic caller (`anthropic-version`) in Anthropic's shape.
        """
        live = await self._admit(flow, trajectory_id, proxied, dialect)
        if live is None:
            return
        live.touch()
        if self.text is not None:
            self.text.forward(flow, b"/models")
            return
        reply = await self.backend.models()
        body = reply.body
        if dialect is MESSAGES:
            body = models_listing(reply.status, body)
        respond(flow, reply.status, body, reply.headers)

    async def count_tokens(
        self, flow: http.HTTPFlow, trajectory_id: str, proxied: bool, raw: bytes, dialect: Dialect
    ) -> None:
        """`POST …/v1/messages/count_tokens`: forwarded (text), the rendered length (tokens).

        Not a model call: nothing is recorded.
        """
        live = await self._admit(flow, trajectory_id, proxied, dialect)
        if live is None:
            return
        try:
            request = dialect.read(parse_json_body(raw))
        except BodyError as exc:
            harness_error(flow, 400, str(exc), None, dialect)
            return
        live.touch()
        if self.text is not None:
            self.text.forward(flow, dialect.upstream_path + b"/count_tokens")
            return
        counted = await self.backend.count_tokens(request, dialect)
        if isinstance(counted, int):
            respond(flow, 200, orjson.dumps({"input_tokens": counted}))
        else:
            respond(flow, counted.status, counted.body, counted.headers)

    async def call(
        self, flow: http.HTTPFlow, trajectory_id: str, proxied: bool, raw: bytes, dialect: Dialect
    ) -> TextCall | None:
        """Steps 1-5 of http.md §3, then the call; returns a text-mode call to the hooks."""
        live = await self._admit(flow, trajectory_id, proxied, dialect)
        if live is None:
            return None
        try:
            request = dialect.read(parse_json_body(raw))
            if dialect is RESPONSES:
                place(live.trajectory, request, token_mode=self.text is None)
        except BodyError as exc:
            harness_error(flow, 400, str(exc), None, dialect, exc.param)
            return None
        except UnknownResponse as exc:
            harness_error(flow, 404, str(exc), None, dialect, "previous_response_id")
            return None
        entry = await self._deduplicate(flow, live, raw, dialect, request)
        if entry is None:
            return None
        if self.text is not None:
            return await self.text.call(flow, live, request, entry, dialect)
        await self._token_call(flow, live, request, entry, dialect)
        return None

    async def stored_response(
        self, flow: http.HTTPFlow, trajectory_id: str, proxied: bool, response_id: str
    ) -> None:
        """`GET …/v1/responses/{id}`: the upstream's (text), or the reply answered (tokens)."""
        live = await self._admit(flow, trajectory_id, proxied, RESPONSES)
        if live is None:
            return
        live.touch()
        if self.text is not None:
            self.text.forward(flow, RESPONSES.upstream_path + b"/" + response_id.encode())
            return
        body = self.backend.stored_reply(trajectory_id, response_id)
        if body is None:
            message = f"Response with id '{response_id}' not found in trajectory {trajectory_id}"
            harness_error(flow, 404, message, None, RESPONSES)
        else:
            respond(flow, 200, body)

    async def _admit(
        self, flow: http.HTTPFlow, trajectory_id: str, proxied: bool, dialect: Dialect
    ) -> Live | None:
        """The gate, then whether this server can forward the call at all."""
        live = await self._gate(flow, trajectory_id, proxied, dialect)
        if live is None or self.text is None or self.text.has_upstream or proxied:
            return live
        harness_error(flow, 502, NO_UPSTREAM, None, dialect)
        return None

    async def _gate(
        self, flow: http.HTTPFlow, trajectory_id: str, proxied: bool, dialect: Dialect
    ) -> Live | None:
        """Steps 1-3 of http.md §3; answers the flow and returns None when a step fails.

        Through the proxy, step 3 already happened on the proxy credentials: the
        harness's own `Authorization` is whatever its SDK was configured with.
        """
        live = self.store.get(trajectory_id) if is_trajectory_id(trajectory_id) else None
        if live is None:
            if self.store.records.on_disk(trajectory_id):
                message = await self._ended_message(trajectory_id)
                harness_error(flow, 410, message, "trajectory_closed", dialect)
            else:
                harness_error(flow, 404, UNKNOWN, None, dialect)
            return None
        if (refusal := self._closed(live)) is not None:
            harness_error(flow, *refusal, dialect)
            return None
        if self.require_api_key and not proxied:
            fields = flow.request.headers.fields
            header = raw_header(fields, b"authorization")
            api_key = raw_header(fields, b"x-api-key")
            if not authorized(header, live.api_key) and not key_matches(api_key, live.api_key):
                message = key_refusal(header, api_key)
                harness_error(flow, 401, message, "invalid_api_key", dialect)
                return None
        return live

    async def _ended_message(self, trajectory_id: str) -> str:
        """Step 1's 410 message: a record written open at a shutdown is not ended (http.md §6)."""
        if await self.store.records.written_unended(trajectory_id):
            return (
                "trajectory was written to disk when the server stopped; it takes no more "
                f"calls, finish it with POST /trajectories/{trajectory_id}/finish"
            )
        return "trajectory has ended"

    async def _deduplicate(
        self, flow: http.HTTPFlow, live: Live, raw: bytes, dialect: Dialect, request: Request
    ) -> Entry | None:
        """Step 5 (http.md §5): answer a retry from its original, or register this call."""
        headers = flow.request.headers
        key = call_key(raw, headers.get("x-stainless-retry-count"), headers.get("idempotency-key"))
        if key.dedup:
            if request.stream and self.streams is not None and live.retries.running(key):
                self._stream_retry(flow, live, key, request, dialect)
                return None
            try:
                found = await live.retries.lookup(key)
            except Conflict as exc:
                harness_error(flow, 400, str(exc), None, dialect)
                return None
            if found is not None:
                _count_replay(live, found)
                replay = found.replay
                respond(flow, replay.status, replay.body, http.Headers(replay.headers))
                return None
            if (refusal := self._closed(live)) is not None:
                harness_error(flow, *refusal, dialect)
                return None
        return live.retries.register(key)

    def _closed(self, live: Live) -> tuple[int, str, str] | None:
        """(status, message, code) when `live` takes no more calls: at the gate, and again
        for a retry whose original ended (it may have been sealed while it waited).

        Closed to calls with its status unchanged (shutdown, or rebuilt from a crash
        journal and not yet written), or ended.
        """
        if live.closed is not None:
            if live.closed == SHUTTING_DOWN:
                return 503, live.closed, "server_shutting_down"
            return 410, live.closed, "trajectory_closed"
        if not live.trajectory.is_open or self.store.get(live.id) is not live:
            return 410, f"trajectory is {live.trajectory.status}", "trajectory_closed"
        return None

    def _stream_retry(
        self, flow: http.HTTPFlow, live: Live, key: CallKey, request: Request, dialect: Dialect
    ) -> None:
        """A streamed retry of a token-mode call still running (http.md §5).

        It is answered from the stream sink at once, with the dialect's keep-alive every
        `--keepalive` seconds while the original runs, so a harness with an idle timeout
        does not give up again; then the original's reply, as SSE. If the original ends
        with nothing to replay, the retry runs as a new call on that same stream.
        """
        stream = ReplyStream(self.keepalive)
        writer = waiting_writer(dialect, request)
        stream.open(
            writer.keepalive, {"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        present = _presence(flow, stream)
        self._to_sink(flow, stream)
        task = asyncio.ensure_future(
            self._answer_retry(live, key, request, dialect, stream, writer, present)
        )
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)

    async def _answer_retry(
        self,
        live: Live,
        key: CallKey,
        request: Request,
        dialect: Dialect,
        stream: ReplyStream,
        writer: StreamWriter,
        present: Callable[[], bool],
    ) -> None:
        """Wait for the original; send its reply, or run the retry as the call (see above)."""
        try:
            try:
                found = await live.retries.lookup(key)
            except Conflict as exc:
                stream.put(writer.error(400, str(exc)))
                return
            if found is not None:
                _count_replay(live, found)
                stream.put(found.replay.body)
                return
            if (refusal := self._closed(live)) is not None:
                stream.put(writer.error(refusal[0], refusal[1]))
                return
            entry = live.retries.register(key)
            task = self._start_turn(live, request, dialect, stream, present)
            reply = await self._settle(task, None, live, entry, dialect)
            if stream.closed:
                return  # the turn wrote its reply, or its failure, to the stream
            if reply is not None:  # refused before the turn opened its stream
                stream.put(error_event(writer, reply.status, reply.body))
            elif not live.trajectory.is_open:
                stream.put(writer.error(410, "the trajectory was closed while this call ran"))
            else:
                stream.put(writer.error(500, "token mode failed; the server log says why"))
        finally:
            if not stream.closed:
                stream.close()

    async def _token_call(
        self, flow: http.HTTPFlow, live: Live, request: Any, entry: Entry, dialect: Dialect
    ) -> None:
        """Run the turn as its own task (a client disconnect does not cancel it); sealing does.

        A streamed call whose turn opens its stream is re-targeted to the stream
        sink and answered from there as it is generated; the turn settles when it ends.
        """
        stream = ReplyStream(self.keepalive) if request.stream and self.streams else None
        task = self._start_turn(live, request, dialect, stream, _presence(flow, stream))
        if stream is not None:
            opened = asyncio.ensure_future(stream.opened.wait())
            try:
                await asyncio.wait((task, opened), return_when=asyncio.FIRST_COMPLETED)
            finally:
                opened.cancel()
            if stream.opened.is_set():
                self._to_sink(flow, stream)
                settling = asyncio.ensure_future(self._settle(task, None, live, entry, dialect))
                live.inflight[settling] = lambda: None  # the task itself is what sealing cancels
                settling.add_done_callback(lambda done: live.inflight.pop(done, None))
                return
        await self._settle(task, flow, live, entry, dialect)

    def _start_turn(
        self,
        live: Live,
        request: Request,
        dialect: Dialect,
        stream: ReplyStream | None,
        present: Callable[[], bool],
    ) -> asyncio.Future[Any]:
        """The backend's turn as a task of its own, in flight until it settles."""
        task = asyncio.ensure_future(
            self.backend.call(live.trajectory, request, dialect, stream, present)
        )
        live.inflight[task] = task.cancel
        live.touch()
        return task

    def _to_sink(self, flow: http.HTTPFlow, stream: ReplyStream) -> None:
        """Re-target the harness's flow to the stream sink, which answers it from `stream`."""
        assert self.streams is not None
        data = flow.request.data
        data.scheme, data.host, data.port = b"http", "127.0.0.1", self.streams.port
        data.path = self.streams.register(stream)
        data.headers.fields = ((b"host", b"127.0.0.1"), (b"content-length", b"0"))
        data.content = b""
        flow.metadata[STREAMED] = True

    async def _settle(
        self,
        task: asyncio.Future[Any],
        flow: http.HTTPFlow | None,
        live: Live,
        entry: Entry,
        dialect: Dialect,
    ) -> Any:
        """Wait for the turn; settle its retry entry, count the commit, answer `flow` if any.

        Returns the turn's Reply, or None when it was cancelled or failed.
        """
        try:
            reply = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            reply = None
        except Exception as exc:  # a backend bug must not take the connection's hook down
            logger.warning("token-mode call of %s failed: %r", live.id, exc)
            if flow is not None:
                message = f"token mode failed: {type(exc).__name__}: {exc}"
                harness_error(flow, 500, message, None, dialect)
            reply = None
        finally:
            live.inflight.pop(task, None)
            live.touch()
        if reply is None:
            entry.settle(None)
            if flow is not None and flow.response is None and flow.killable:
                flow.kill()
            return None
        fields = [(k.encode(), v.encode()) for k, v in reply.headers.items()]
        entry.settle(Replay.of(reply.status, fields, reply.body) if reply.replayable else None)
        if reply.call is not None:
            self.store.note_commit(live, reply.call)
        elif not live.trajectory.is_open:
            live.cancel_inflight()
        if flow is not None:
            respond(flow, reply.status, reply.body, reply.headers)
        return reply


def _count_replay(live: Live, found: Found) -> None:
    counters = live.trajectory.retries
    counters["replayed"] += 1
    if found.coalesced:
        counters["coalesced"] += 1


def _presence(flow: http.HTTPFlow, stream: ReplyStream | None) -> Callable[[], bool]:
    """Whether the harness of `flow` is still there to receive its reply's end:
    its connection is open and it has not left the flow or, streamed, the stream."""
    conn, metadata = flow.client_conn, flow.metadata

    def present() -> bool:
        if metadata.get(HARNESS_LEFT) or (stream is not None and stream.harness_left):
            return False
        return client_connected(conn)

    return present


def key_refusal(header: bytes | None, api_key: bytes | None = None) -> str:
    """The 401 message (http.md §3 step 3), saying why when a key was sent.

    The key may come as `Authorization: Bearer` or as `x-api-key` (Anthropic SDKs).
    """
    message = "this trajectory's api_key is required"
    if api_key:
        return f"{message}: the key sent is not this trajectory's"
    if not header:
        return message
    if bearer_key(header) is None:
        return f"{message}: send it as `Authorization: Bearer <api_key>` or `x-api-key`"
    return f"{message}: the key sent is not this trajectory's"

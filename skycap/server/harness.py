"""The harness routes of http.md §3: admit a call, check its body, de-duplicate retries, run it.

The addon hands a model call (with its dialect, skycap.dialects) or a model-list call
here once its body is read and within `--max-body-size` (D-10), whether it came as
`/t/{id}/v1/...` or through the proxy listener (D-24). Text mode then forwards it with
skycap's own client (`textmode`); token mode answers it from the token backend. Either
way the call runs as its own task, so a client disconnect does not cancel it (http.md §5).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from mitmproxy import http

from skycap.dialects import Dialect
from skycap.dialects.chat import DIALECT as CHAT
from skycap.dialects.messages import DIALECT as MESSAGES
from skycap.dialects.messages import models_listing
from skycap.dialects.responses import DIALECT as RESPONSES
from skycap.server.keys import authorized, bearer_key, key_matches, raw_header
from skycap.server.live import Live
from skycap.server.options import ServerOptions
from skycap.server.responses import UnknownResponse, place
from skycap.server.retry import Conflict, Entry, Replay, call_key
from skycap.server.store import SHUTTING_DOWN, UNKNOWN, TrajectoryStore
from skycap.server.stream_sink import StreamSink
from skycap.server.textmode import TextCall, TextMode
from skycap.tokens.streaming import ReplyStream
from skycap.trajectory import is_trajectory_id
from skycap.wire import BodyError, parse_json_body

logger = logging.getLogger("skycap.server")

#: Set on a flow answered from the stream sink: its response passes through unbuffered.
STREAMED = "skycap.streamed"

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
    """Answer with the error body the caller's SDK reads, in its dialect (http.md §1, D-36)."""
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
        entry = await self._deduplicate(flow, live, raw, dialect)
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
        """The gate, then whether this server can forward the call at all (D-8)."""
        live = await self._gate(flow, trajectory_id, proxied, dialect)
        if live is None or self.text is None or self.text.has_upstream or proxied:
            return live
        harness_error(flow, 502, NO_UPSTREAM, None, dialect)
        return None

    async def _gate(
        self, flow: http.HTTPFlow, trajectory_id: str, proxied: bool, dialect: Dialect
    ) -> Live | None:
        """Steps 1-3 of http.md §3; answers the flow and returns None when a step fails.

        Through the proxy, step 3 already happened on the proxy credentials (D-24): the
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
        if live.closed is not None:
            # D-44: closed to calls with its status unchanged (shutdown, or rebuilt from a
            # crash journal and not yet written).
            if live.closed == SHUTTING_DOWN:
                harness_error(flow, 503, live.closed, "server_shutting_down")
            else:
                harness_error(flow, 410, live.closed, "trajectory_closed")
            return None
        if not live.trajectory.is_open:
            status = live.trajectory.status
            harness_error(flow, 410, f"trajectory is {status}", "trajectory_closed", dialect)
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
        self, flow: http.HTTPFlow, live: Live, raw: bytes, dialect: Dialect
    ) -> Entry | None:
        """Step 5 (http.md §5): answer a retry from its original, or register this call."""
        headers = flow.request.headers
        key = call_key(raw, headers.get("x-stainless-retry-count"), headers.get("idempotency-key"))
        if key.dedup:
            try:
                found = await live.retries.lookup(key)
            except Conflict as exc:
                harness_error(flow, 400, str(exc), None, dialect)
                return None
            if found is not None:
                counters = live.trajectory.retries
                counters["replayed"] += 1
                if found.coalesced:
                    counters["coalesced"] += 1
                replay = found.replay
                respond(flow, replay.status, replay.body, http.Headers(replay.headers))
                return None
            if not live.trajectory.is_open or self.store.get(live.id) is not live:
                status = live.trajectory.status
                harness_error(flow, 410, f"trajectory is {status}", "trajectory_closed", dialect)
                return None
        return live.retries.register(key)

    async def _token_call(
        self, flow: http.HTTPFlow, live: Live, request: Any, entry: Entry, dialect: Dialect
    ) -> None:
        """Run the turn as its own task (a client disconnect does not cancel it); sealing does.

        A streamed call whose turn opens its stream (D-51) is re-targeted to the stream
        sink and answered from there as it is generated; the turn settles when it ends.
        """
        stream = ReplyStream(self.keepalive) if request.stream and self.streams else None
        task = asyncio.ensure_future(self.backend.call(live.trajectory, request, dialect, stream))
        live.inflight[task] = task.cancel
        live.touch()
        if stream is not None:
            opened = asyncio.ensure_future(stream.opened.wait())
            try:
                await asyncio.wait((task, opened), return_when=asyncio.FIRST_COMPLETED)
            finally:
                opened.cancel()
            if stream.opened.is_set():
                assert self.streams is not None
                data = flow.request.data
                data.scheme, data.host, data.port = b"http", "127.0.0.1", self.streams.port
                data.path = self.streams.register(stream)
                data.headers.fields = ((b"host", b"127.0.0.1"), (b"content-length", b"0"))
                data.content = b""
                flow.metadata[STREAMED] = True
                settling = asyncio.ensure_future(self._settle(task, None, live, entry, dialect))
                live.inflight[settling] = lambda: None  # the task itself is what sealing cancels
                settling.add_done_callback(lambda done: live.inflight.pop(done, None))
                return
        await self._settle(task, flow, live, entry, dialect)

    async def _settle(
        self,
        task: asyncio.Future[Any],
        flow: http.HTTPFlow | None,
        live: Live,
        entry: Entry,
        dialect: Dialect,
    ) -> None:
        """Wait for the turn; settle its retry entry, count the commit, answer `flow` if any."""
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
            return
        fields = [(k.encode(), v.encode()) for k, v in reply.headers.items()]
        entry.settle(Replay.of(reply.status, fields, reply.body) if reply.replayable else None)
        if reply.call is not None:
            self.store.note_commit(live, reply.call)
        elif not live.trajectory.is_open:
            live.cancel_inflight()
        if flow is not None:
            respond(flow, reply.status, reply.body, reply.headers)


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

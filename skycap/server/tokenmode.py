"""Token mode as the server's call mode: the token backend's turns driven for harness flows.

Each model call runs the backend's turn as its own task, so a client disconnect does not
cancel it (only sealing the trajectory does); the backend is told, at the commit, whether
the harness is still there. A streamed call whose turn opens its stream is re-targeted
to the loopback and answered there as it is generated. A streamed retry of a call still
running is answered from the loopback at once, with keep-alives until the original's
reply is there to send. Model lists, token counts and stored replies come from the
backend.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson
from mitmproxy import http

from skycap.dialects import Dialect, Request, StreamWriter
from skycap.server.conns import client_connected
from skycap.server.flowstate import state_of
from skycap.server.harness import closed_refusal, count_replay
from skycap.server.live import Live
from skycap.server.loopback import GeneratedReply, Loopback
from skycap.server.mode import RunningCall, harness_error, respond
from skycap.server.options import ServerOptions
from skycap.server.retry import CallKey, Conflict, Entry, Replay
from skycap.server.store import TrajectoryStore
from skycap.tokens.backend import TokenBackend
from skycap.tokens.outcome import Reply
from skycap.tokens.relay import error_event, waiting_writer
from skycap.tokens.streaming import ReplyStream

logger = logging.getLogger("skycap.server")


class TokenMode:
    """The `CallMode` of a token-mode server, over one `TokenBackend`."""

    renders = True

    def __init__(self, options: ServerOptions, loopback: Loopback) -> None:
        self.backend = TokenBackend.from_options(options)
        self.capture: dict[str, Any] = self.backend.capture
        self.release = self.backend.release
        self.provenance = self.backend.provenance
        self.decode_spans = self.backend.decode_spans
        self.counters = self.backend.settings.cache_counters
        self.keepalive = options.keepalive
        self.logprobs_mode = options.logprobs_mode
        self.loopback = loopback
        self.store: TrajectoryStore | None = None
        #: Streamed retries waiting on their original (held so they are not collected).
        self._waiting: set[asyncio.Future[None]] = set()

    def attach(self, store: TrajectoryStore) -> None:
        self.store = store
        store.episodes["engine_connect"] = self.backend.client.unreachable

    async def start(self) -> None:
        await self.backend.start()  # learns the served model name

    async def close(self) -> None:
        await self.backend.close()

    def refusal(self, proxied: bool) -> str | None:
        return None

    def describe(self) -> str:
        return (
            f"token mode: {self.backend.served.describe()}; logprobs_mode "
            f"{self.logprobs_mode} (vLLM's --logprobs-mode must match: its default is "
            f"raw_logprobs); {self.backend.describe_pool()}"
        )

    async def models(
        self, flow: http.HTTPFlow, live: Live, suffix: bytes, dialect: Dialect
    ) -> None:
        """The served model, in the caller's dialect's shape."""
        reply = await self.backend.models()
        respond(flow, reply.status, dialect.models_listing(reply.status, reply.body), reply.headers)

    async def count_tokens(
        self, flow: http.HTTPFlow, live: Live, request: Request, suffix: bytes, dialect: Dialect
    ) -> None:
        """The rendered prompt's length."""
        counted = await self.backend.count_tokens(request, dialect)
        if isinstance(counted, int):
            respond(flow, 200, orjson.dumps({"input_tokens": counted}))
        else:
            respond(flow, counted.status, counted.body, counted.headers)

    async def stored_reply(
        self, flow: http.HTTPFlow, live: Live, reply_id: str, suffix: bytes, dialect: Dialect
    ) -> None:
        """The reply answered under `reply_id` in this trajectory."""
        body = self.backend.stored_reply(live.id, reply_id)
        if body is None:
            message = f"Response with id '{reply_id}' not found in trajectory {live.id}"
            harness_error(flow, 404, message, None, dialect)
        else:
            respond(flow, 200, body)

    def harness_left(self, flow: http.HTTPFlow, forwarded: bool, dialect: Dialect) -> None:
        state_of(flow).harness_left = True  # a call committing now is marked so

    # -- model calls ----------------------------------------------------------------------------

    async def call(
        self, flow: http.HTTPFlow, live: Live, request: Request, entry: Entry, dialect: Dialect
    ) -> RunningCall | None:
        """Run the turn as its own task (a client disconnect does not cancel it); sealing does.

        A streamed call whose turn opens its stream is re-targeted to the loopback and
        answered from there as it is generated; the turn settles when it ends.
        """
        stream = ReplyStream(self.keepalive) if request.stream else None
        task = self._start_turn(live, request, dialect, stream, _presence(flow, stream))
        if stream is not None:
            opened = asyncio.ensure_future(stream.opened.wait())
            try:
                await asyncio.wait((task, opened), return_when=asyncio.FIRST_COMPLETED)
            finally:
                opened.cancel()
            if stream.opened.is_set():
                self._send_generated(flow, stream)
                settling = asyncio.ensure_future(
                    self._settle_turn(task, None, live, entry, dialect)
                )
                live.inflight[settling] = lambda: None  # the task itself is what sealing cancels
                settling.add_done_callback(lambda done: live.inflight.pop(done, None))
                return None
        await self._settle_turn(task, flow, live, entry, dialect)
        return None

    def join_running(
        self, flow: http.HTTPFlow, live: Live, key: CallKey, request: Request, dialect: Dialect
    ) -> bool:
        """A streamed retry of a call still running is answered from the loopback at once,
        with the dialect's keep-alive every `--keepalive` seconds while the original runs,
        so a harness with an idle timeout does not give up again; then the original's
        reply, as SSE. If the original ends with nothing to replay, the retry runs as a new
        call on that same stream.
        """
        stream = ReplyStream(self.keepalive)
        writer = waiting_writer(dialect, request)
        stream.open(
            writer.keepalive, {"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        present = _presence(flow, stream)
        self._send_generated(flow, stream)
        task = asyncio.ensure_future(
            self._answer_retry(live, key, request, dialect, stream, writer, present)
        )
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)
        return True

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
        assert self.store is not None
        try:
            try:
                found = await live.retries.lookup(key)
            except Conflict as exc:
                stream.put(writer.error(400, str(exc)))
                return
            if found is not None:
                count_replay(live, found)
                stream.put(found.replay.body)
                return
            if (refusal := closed_refusal(self.store, live)) is not None:
                stream.put(writer.error(refusal[0], refusal[1]))
                return
            entry = live.retries.register(key)
            task = self._start_turn(live, request, dialect, stream, present)
            reply = await self._settle_turn(task, None, live, entry, dialect)
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

    def _start_turn(
        self,
        live: Live,
        request: Request,
        dialect: Dialect,
        stream: ReplyStream | None,
        present: Callable[[], bool],
    ) -> asyncio.Future[Reply]:
        """The backend's turn as a task of its own, in flight until it settles."""
        task = asyncio.ensure_future(
            self.backend.call(live.trajectory, request, dialect, stream, present)
        )
        live.inflight[task] = task.cancel
        live.touch()
        return task

    def _send_generated(self, flow: http.HTTPFlow, stream: ReplyStream) -> None:
        """Re-target the harness's flow to the loopback, which answers it from `stream`."""
        self.loopback.retarget(flow, GeneratedReply(stream))
        state_of(flow).streamed = True

    async def _settle_turn(
        self,
        task: asyncio.Future[Reply],
        flow: http.HTTPFlow | None,
        live: Live,
        entry: Entry,
        dialect: Dialect,
    ) -> Reply | None:
        """Wait for the turn; settle its retry entry, count the commit, answer `flow` if any.

        Returns the turn's Reply, or None when it was cancelled or failed.
        """
        assert self.store is not None
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


def _presence(flow: http.HTTPFlow, stream: ReplyStream | None) -> Callable[[], bool]:
    """Whether the harness of `flow` is still there to receive its reply's end: its
    connection is open and it has not left the flow or, streamed, the stream."""
    conn, state = flow.client_conn, state_of(flow)

    def present() -> bool:
        if state.harness_left or (stream is not None and stream.harness_left):
            return False
        return client_connected(conn)

    return present

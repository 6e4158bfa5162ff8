"""The harness routes of docs/http.md: admit a call, check its body, de-duplicate retries.

The addon hands a model call (with its dialect, skycap.dialects), a token count, a model
list or a stored-reply read here once its body is read and within `--max-body-size`,
whether it came as `/t/{id}/v1/...` or through the proxy listener. What is checked here
is the same in every mode; running the call is the server's `CallMode` (`mode`): text
mode forwards it with skycap's own client, token mode answers it from the engine. Either
way the call runs as its own task, so a client disconnect does not cancel it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mitmproxy import http

from skycap.dialects import Dialect, Request, UnknownReply
from skycap.server.earlier import EarlierReplies
from skycap.server.keys import authorized, bearer_key, key_matches, raw_header, text_header
from skycap.server.live import Live
from skycap.server.mode import CallMode, RunningCall, harness_error, respond
from skycap.server.options import ServerOptions
from skycap.server.retry import Conflict, Entry, Found, call_key
from skycap.server.store import SHUTTING_DOWN, UNKNOWN, TrajectoryStore
from skycap.trajectory import is_trajectory_id
from skycap.wire import BodyError, parse_json_body


class Harness:
    """Admits harness calls into one store and hands them to the server's mode."""

    def __init__(self, options: ServerOptions, store: TrajectoryStore, mode: CallMode) -> None:
        self.require_api_key = options.require_api_key
        self.store = store
        self.mode = mode

    async def models(
        self,
        flow: http.HTTPFlow,
        trajectory_id: str,
        proxied: bool,
        suffix: bytes,
        dialect: Dialect,
    ) -> None:
        """The model list, in the caller's dialect."""
        live = await self.admit(flow, trajectory_id, proxied, dialect)
        if live is not None:
            live.touch()
            await self.mode.models(flow, live, suffix, dialect)

    async def count_tokens(
        self,
        flow: http.HTTPFlow,
        trajectory_id: str,
        proxied: bool,
        raw: bytes,
        suffix: bytes,
        dialect: Dialect,
    ) -> None:
        """A call's prompt length (`…/v1/messages/count_tokens`). Not a model call: nothing
        is recorded."""
        live = await self.admit(flow, trajectory_id, proxied, dialect)
        if live is None:
            return
        try:
            request = dialect.read(parse_json_body(raw))
        except BodyError as exc:
            harness_error(flow, 400, str(exc), None, dialect)
            return
        live.touch()
        await self.mode.count_tokens(flow, live, request, suffix, dialect)

    async def call(
        self,
        flow: http.HTTPFlow,
        trajectory_id: str,
        proxied: bool,
        raw: bytes,
        dialect: Dialect,
        recorded: Mapping[str, Any] | None = None,
    ) -> RunningCall | None:
        """The gate, the body, the retry check, then the call; returns a call still running
        for the response hooks to finish, if the mode leaves one. `recorded` are fields
        the call records for how it came (`transport` for a WebSocket message)."""
        live = await self.admit(flow, trajectory_id, proxied, dialect)
        if live is None:
            return None
        try:
            request = dialect.read(parse_json_body(raw))
            request.recorded.update(recorded or {})
            earlier = EarlierReplies(live.trajectory, dialect.reply_id_key)
            dialect.prepare(request, earlier, self.mode.renders)
        except BodyError as exc:
            harness_error(flow, 400, str(exc), None, dialect, exc.param)
            return None
        except UnknownReply as exc:
            harness_error(flow, 404, str(exc), None, dialect, exc.param)
            return None
        entry = await self._deduplicate(flow, live, raw, dialect, request)
        if entry is None:
            return None
        return await self.mode.call(flow, live, request, entry, dialect)

    async def stored_reply(
        self,
        flow: http.HTTPFlow,
        trajectory_id: str,
        proxied: bool,
        reply_id: str,
        suffix: bytes,
        dialect: Dialect,
    ) -> None:
        """`GET …/v1/responses/{id}`: a reply by id, as the mode keeps it."""
        live = await self.admit(flow, trajectory_id, proxied, dialect)
        if live is not None:
            live.touch()
            await self.mode.stored_reply(flow, live, reply_id, suffix, dialect)

    async def admit(
        self, flow: http.HTTPFlow, trajectory_id: str, proxied: bool, dialect: Dialect
    ) -> Live | None:
        """The gate, then whether this server can run the call at all."""
        live = await self._gate(flow, trajectory_id, proxied, dialect)
        if live is None or (refusal := self.mode.refusal(proxied)) is None:
            return live
        harness_error(flow, 502, refusal, None, dialect)
        return None

    async def _gate(
        self, flow: http.HTTPFlow, trajectory_id: str, proxied: bool, dialect: Dialect
    ) -> Live | None:
        """Steps 1-3 of the gate; answers the flow and returns None when a step fails.

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
        if (refusal := closed_refusal(self.store, live)) is not None:
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
        fields = flow.request.data.headers.fields
        retry_count = text_header(fields, b"x-stainless-retry-count")
        key = call_key(raw, retry_count, text_header(fields, b"idempotency-key"))
        if key.dedup:
            if request.stream and live.retries.running(key):
                if self.mode.join_running(flow, live, key, request, dialect):
                    return None
            try:
                found = await live.retries.lookup(key)
            except Conflict as exc:
                harness_error(flow, 400, str(exc), None, dialect)
                return None
            if found is not None:
                count_replay(live, found)
                replay = found.replay
                respond(flow, replay.status, replay.body, http.Headers(replay.headers))
                return None
            if (refusal := closed_refusal(self.store, live)) is not None:
                harness_error(flow, *refusal, dialect)
                return None
        return live.retries.register(key)


def closed_refusal(store: TrajectoryStore, live: Live) -> tuple[int, str, str] | None:
    """(status, message, code) when `live` takes no more calls: at the gate, and again
    for a retry whose original ended (it may have been sealed while it waited).

    Closed to calls with its status unchanged (shutdown, or rebuilt from a crash journal
    and not yet written), or ended.
    """
    if live.closed is not None:
        if live.closed == SHUTTING_DOWN:
            return 503, live.closed, "server_shutting_down"
        return 410, live.closed, "trajectory_closed"
    if not live.trajectory.is_open or store.get(live.id) is not live:
        return 410, f"trajectory is {live.trajectory.status}", "trajectory_closed"
    return None


def count_replay(live: Live, found: Found) -> None:
    """A retry answered from its original: the trajectory's retry counters."""
    counters = live.trajectory.retries
    counters["replayed"] += 1
    if found.coalesced:
        counters["coalesced"] += 1


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

"""The skycap mitmproxy addon: routes control and harness requests over one trajectory store.

It stays thin (docs/architecture.md): routing, the harness gating of http.md §3, body
size (D-10) and retry de-duplication (http.md §5) happen here; lifecycle lives in
`store`, control answers in `control`, forwarding in `textmode`, token turns in the
token backend, proxy credentials and pass-through in `proxy`. A call captured through
the proxy listener (`--proxy-port`) takes the same path as a `/t/{id}/v1` call from the
gate on; only where the trajectory id comes from differs (D-24). Built either from a
ServerOptions (`skycap serve`, CaptureService) or, under `mitmdump -s addons/skycap.py`,
from the `skycap_*` options (D-20).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import orjson
from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.proxy.mode_specs import RegularMode

from skycap.certs import ensure_ca
from skycap.server import options as options_module
from skycap.server.conns import Connections, listen_address
from skycap.server.control import Control
from skycap.server.drain import CONTROL_PATH, HARNESS_PATH, DrainSink, too_large_message
from skycap.server.keys import authorized
from skycap.server.options import ServerOptions
from skycap.server.proxy import Proxy, ProxyAuthRequired
from skycap.server.retry import Conflict, Entry, Replay, call_key
from skycap.server.store import UNKNOWN, Answer, Live, TrajectoryStore
from skycap.server.textmode import TextCall, TextMode
from skycap.trajectory import is_trajectory_id
from skycap.wire import BodyError, check_chat_request, openai_error, parse_json_body

logger = logging.getLogger("skycap.server")
access_log = logging.getLogger("skycap.access")

_JSON = ((b"content-type", b"application/json"),)
ROUTE = "skycap.route"
CALL = "skycap.call"
PROXIED = "skycap.proxied"

# Route kinds.
HEALTH, LIST, CREATE, FINISH, DOCUMENT = "health", "list", "create", "finish", "document"
CHAT, MODELS, HARNESS_MISS, MISS, OVERSIZE = "chat", "models", "harness-miss", "miss", "oversize"
PASS, ANSWERED = "pass", "answered"  # proxy listener: not captured / refused in requestheaders
HARNESS_KINDS = frozenset({CHAT, MODELS, HARNESS_MISS})


def route(method: str, path: str) -> tuple[str, str | None]:
    """(kind, trajectory id) for a request line; matching is exact (http.md §1, D-7)."""
    path = path.partition("?")[0]
    if path.startswith("/t/"):
        trajectory_id, _, tail = path[3:].partition("/")
        if tail == "v1/chat/completions" and method == "POST":
            return CHAT, trajectory_id
        if tail == "v1/models" and method == "GET":
            return MODELS, trajectory_id
        return HARNESS_MISS, None
    if path == "/healthz" and method == "GET":
        return HEALTH, None
    if path == "/trajectories":
        return {"POST": CREATE, "GET": LIST}.get(method, MISS), None
    if path.startswith("/trajectories/"):
        trajectory_id, _, tail = path[14:].partition("/")
        if tail == "" and method == "GET":
            return DOCUMENT, trajectory_id
        if tail == "finish" and method == "POST":
            return FINISH, trajectory_id
    return MISS, None


def proxy_route(method: str, path: str) -> str:
    """The kind of a request through the proxy listener (D-24): captured, or passed through.

    Matching is by suffix so deployment paths (`/openai/deployments/x/chat/completions`)
    are captured too.
    """
    path = path.partition("?")[0]
    if method == "POST" and path.endswith("/chat/completions"):
        return CHAT
    if method == "GET" and path.endswith("/models"):
        return MODELS
    return PASS


def _respond(flow: http.HTTPFlow, status: int, body: bytes, headers: Any = _JSON) -> None:
    flow.response = http.Response.make(status, body, headers)


def _harness_error(flow: http.HTTPFlow, status: int, message: str, code: str | None = None) -> None:
    _respond(flow, status, openai_error(status, message, code))


@contextlib.contextmanager
def _logged(flow: http.HTTPFlow, hook: str) -> Iterator[None]:
    """A bug in a response-side hook is logged as a warning, never shown as a traceback."""
    try:
        yield
    except Exception as exc:
        logger.warning("%s hook for %s failed: %r", hook, flow.request.path, exc)
        logger.debug("traceback", exc_info=True)


def _header_bytes(flow: http.HTTPFlow, name: bytes) -> bytes | None:
    """A request header's raw bytes (keys are compared as bytes, http.md §4)."""
    for key, value in flow.request.headers.fields:
        if key.lower() == name:
            return value
    return None


class SkycapAddon:
    """One capture server as a mitmproxy addon. Pass `options` unless mitmdump supplies them."""

    def __init__(self, options: ServerOptions | None = None) -> None:
        self._from_script = options is None
        self.options: ServerOptions | None = None
        self.store: TrajectoryStore | None = None
        self.backend: Any = None
        self.running_loop: asyncio.AbstractEventLoop | None = None
        self.conns = Connections()
        self.proxy: Proxy | None = None
        if options is not None:
            self._build(options)

    def _build(self, options: ServerOptions) -> None:
        self.options = options
        release = decode_spans = None
        if options.mode == "tokens":
            from skycap.tokens.backend import TokenBackend

            self.backend = TokenBackend.from_options(options)
            capture = self.backend.capture
            release, decode_spans = self.backend.release, self.backend.decode_spans
        else:
            capture = {"mode": "text"}
        self.store = TrajectoryStore(options, capture, release=release, decode_spans=decode_spans)
        if options.proxy_port is not None:
            self.proxy = Proxy(self.store, ensure_ca(options.confdir))
        self.control = Control(self.store, self.proxy)
        self.text = TextMode(options, self.store, self.conns) if options.mode == "text" else None
        self.sink = DrainSink(options.max_body_size)

    # -- mitmproxy lifecycle ------------------------------------------------------------------

    def load(self, loader: Any) -> None:
        if self._from_script:
            options_module.add_addon_options(loader)

    def configure(self, updated: set[str]) -> None:
        if not self._from_script or not any(
            name.startswith(options_module.ADDON_PREFIX) for name in updated
        ):
            return
        if self.running_loop is not None:
            raise exceptions.OptionsError("skycap options cannot change while the server runs")
        try:
            options = options_module.from_addon_options(ctx.options)
        except (ValueError, TypeError) as exc:
            raise exceptions.OptionsError(f"skycap: {exc}") from None
        self._build(options)

    async def running(self) -> None:
        if self.store is None:
            raise exceptions.OptionsError("skycap: set skycap_upstream_url (see addons/skycap.py)")
        self.running_loop = asyncio.get_running_loop()
        proxyserver = ctx.master.addons.get("proxyserver")
        self.conns.attach(proxyserver)
        if self.proxy is not None:
            # A proxy listener that failed to bind is reported by whoever started mitmproxy.
            with contextlib.suppress(LookupError):
                self.proxy.port = listen_address(proxyserver, RegularMode)[1]
        await self.sink.start()
        self.store.start()

    async def done(self) -> None:
        if self.store is None or self.running_loop is None:
            return
        await self.store.shutdown()
        if self.backend is not None:
            await self.backend.close()
        await self.sink.close()

    # -- proxy listener --------------------------------------------------------------------------

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """CONNECT names the tunnel's trajectory (D-24); mitmproxy refuses it in reverse mode."""
        if self.proxy is not None and self.proxy.serves(flow):
            self.proxy.connect(flow)

    def client_disconnected(self, client: connection.Client) -> None:
        if self.proxy is not None:
            self.proxy.forget(client.id)

    def _proxy_route(self, flow: http.HTTPFlow) -> tuple[str, str | None]:
        """Route a request on the proxy listener; a refusal or a pass-through is settled here."""
        assert self.proxy is not None
        try:
            trajectory_id = self.proxy.trajectory_of(flow)
        except ProxyAuthRequired as refused:
            flow.response = refused.response()
            return ANSWERED, None
        kind = proxy_route(flow.request.method, flow.request.path)
        if kind == PASS:
            self.proxy.pass_through(flow, trajectory_id)
            return (ANSWERED if flow.response is not None else PASS), trajectory_id
        flow.metadata[PROXIED] = True
        return kind, trajectory_id

    # -- request hooks -------------------------------------------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Route once; send a body announced as oversize to the drain sink, unread (D-10)."""
        if self.proxy is not None and self.proxy.serves(flow):
            kind, trajectory_id = self._proxy_route(flow)
        else:
            kind, trajectory_id = route(flow.request.method, flow.request.path)
        flow.metadata[ROUTE] = (kind, trajectory_id)
        if kind == PASS or kind == ANSWERED:
            return
        length = flow.request.headers.get("content-length")
        assert self.options is not None
        if length and length.isdigit() and int(length) > self.options.max_body_size:
            flow.metadata[ROUTE] = (OVERSIZE, None)
            data = flow.request.data
            data.scheme, data.host, data.port = b"http", "127.0.0.1", self.sink.port
            data.path = HARNESS_PATH if kind in HARNESS_KINDS else CONTROL_PATH
            flow.request.stream = True

    async def request(self, flow: http.HTTPFlow) -> None:
        kind, trajectory_id = flow.metadata.get(ROUTE) or route(
            flow.request.method, flow.request.path
        )
        if kind == OVERSIZE or kind == PASS or kind == ANSWERED:
            return
        try:
            await self._dispatch(flow, kind, trajectory_id)
        except Exception as exc:  # answer, never fall through to the reverse target (D-7)
            logger.warning("%s %s failed: %r", flow.request.method, flow.request.path, exc)
            logger.debug("traceback", exc_info=True)
            message = f"internal error: {type(exc).__name__}: {exc}"
            if kind in HARNESS_KINDS:
                _harness_error(flow, 500, message)
            else:
                _respond(flow, 500, orjson.dumps({"error": message}))

    async def _dispatch(self, flow: http.HTTPFlow, kind: str, trajectory_id: str | None) -> None:
        raw = flow.request.raw_content or b""
        assert self.options is not None
        if len(raw) > self.options.max_body_size:
            message = too_large_message(len(raw), self.options.max_body_size)
            if kind in HARNESS_KINDS:
                _harness_error(flow, 413, message)
            else:
                _respond(flow, 413, orjson.dumps({"error": message}))
            return
        if kind == CHAT or kind == MODELS:
            await self._harness(flow, kind, trajectory_id, raw)
        elif kind == HARNESS_MISS:
            path = flow.request.path.partition("?")[0]
            _harness_error(flow, 404, f"no route {flow.request.method} {path}")
        else:
            answer = await self._control(flow, kind, trajectory_id, raw)
            _respond(flow, answer.status, answer.body)

    async def _control(
        self, flow: http.HTTPFlow, kind: str, trajectory_id: str | None, raw: bytes
    ) -> Answer:
        if kind == HEALTH:
            return self.control.health()
        if kind == CREATE:
            return self.control.create(raw, self._origin(flow))
        if kind == LIST:
            return self.control.listing()
        if kind == FINISH:
            assert trajectory_id is not None
            return await self.control.finish(trajectory_id, raw)
        if kind == DOCUMENT:
            assert trajectory_id is not None
            return await self.control.document(trajectory_id)
        path = flow.request.path.partition("?")[0]
        return Answer.error(404, f"no route {flow.request.method} {path}")

    def _origin(self, flow: http.HTTPFlow) -> str:
        """Where the caller reached us: the Host header if mitmproxy kept it (D-9)."""
        scheme = "https" if flow.client_conn.tls_established else "http"
        host = flow.request.host_header if ctx.options.keep_host_header else None
        if not host:
            address, port = flow.client_conn.sockname[:2]
            host = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        return f"{scheme}://{host}"

    # -- harness routes (http.md §3) ---------------------------------------------------------

    def _gate(self, flow: http.HTTPFlow, trajectory_id: str, proxied: bool) -> Live | None:
        """Steps 1-3 of http.md §3; answers the flow and returns None when a step fails.

        Through the proxy, step 3 already happened on the proxy credentials (D-24): the
        harness's own `Authorization` is whatever its SDK was configured with.
        """
        assert self.store is not None and self.options is not None
        live = self.store.get(trajectory_id) if is_trajectory_id(trajectory_id) else None
        if live is None:
            if self.store.on_disk(trajectory_id):
                _harness_error(flow, 410, "trajectory has ended", "trajectory_closed")
            else:
                _harness_error(flow, 404, UNKNOWN)
            return None
        if not live.trajectory.is_open:
            status = live.trajectory.status
            _harness_error(flow, 410, f"trajectory is {status}", "trajectory_closed")
            return None
        if (
            self.options.require_api_key
            and not proxied
            and not authorized(_header_bytes(flow, b"authorization"), live.api_key)
        ):
            _harness_error(flow, 401, "this trajectory's api_key is required", "invalid_api_key")
            return None
        return live

    async def _harness(
        self, flow: http.HTTPFlow, kind: str, trajectory_id: str | None, raw: bytes
    ) -> None:
        assert trajectory_id is not None
        proxied = flow.metadata.get(PROXIED, False)
        live = self._gate(flow, trajectory_id, proxied)
        if live is None:
            return
        if self.text is not None and not self.text.has_upstream and not proxied:
            message = (
                "no --upstream-url configured: this server forwards only calls made "
                "through its proxy port (D-8)"
            )
            _harness_error(flow, 502, message)
            return
        if kind == MODELS:
            live.touch()
            if self.text is not None:
                self.text.forward(flow, b"/models")
            else:
                reply = await self.backend.models()
                _respond(flow, reply.status, reply.body, reply.headers)
            return
        try:
            body = check_chat_request(parse_json_body(raw))
        except BodyError as exc:
            _harness_error(flow, 400, str(exc))
            return
        entry = await self._deduplicate(flow, live, raw)
        if entry is None:
            return
        if self.text is not None:
            flow.metadata[CALL] = self.text.start_chat(flow, live, body, entry)
        else:
            await self._token_chat(flow, live, body, entry)

    async def _deduplicate(self, flow: http.HTTPFlow, live: Live, raw: bytes) -> Entry | None:
        """Step 5 (http.md §5): answer a retry from its original, or register this call."""
        headers = flow.request.headers
        key = call_key(raw, headers.get("x-stainless-retry-count"), headers.get("idempotency-key"))
        if key.dedup:
            try:
                found = await live.retries.lookup(key)
            except Conflict as exc:
                _harness_error(flow, 400, str(exc))
                return None
            if found is not None:
                counters = live.trajectory.retries
                counters["replayed"] += 1
                if found.coalesced:
                    counters["coalesced"] += 1
                replay = found.replay
                _respond(flow, replay.status, replay.body, http.Headers(replay.headers))
                return None
            if not live.trajectory.is_open or self.store.get(live.id) is not live:
                _harness_error(
                    flow, 410, f"trajectory is {live.trajectory.status}", "trajectory_closed"
                )
                return None
        return live.retries.register(key)

    async def _token_chat(
        self, flow: http.HTTPFlow, live: Live, body: dict[str, Any], entry: Entry
    ) -> None:
        """Run the turn as its own task (a client disconnect does not cancel it); sealing does."""
        t_start = time.time()
        task = asyncio.ensure_future(self.backend.chat(live.trajectory, body))
        live.inflight[task] = task.cancel
        live.touch()
        try:
            reply = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            reply = None
        except Exception as exc:  # a backend bug must not take the connection's hook down
            logger.warning("token-mode call of %s failed: %r", live.id, exc)
            _harness_error(flow, 500, f"token mode failed: {type(exc).__name__}: {exc}")
            reply = None
        finally:
            live.inflight.pop(task, None)
            live.touch()
        if reply is None:
            entry.settle(None)
            if flow.response is None and flow.killable:
                flow.kill()
            return
        fields = [(k.encode(), v.encode()) for k, v in reply.headers.items()]
        entry.settle(Replay.of(reply.status, fields, reply.body) if reply.replayable else None)
        if reply.headers.get("x-skycap-status") == "ok":
            self.store.note_commit(live, _token_call(reply.body, t_start))
        elif not live.trajectory.is_open:
            live.cancel_inflight()
        _respond(flow, reply.status, reply.body, reply.headers)

    # -- response hooks (text mode) ------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call: TextCall | None = flow.metadata.get(CALL)
        if call is not None:
            with _logged(flow, "responseheaders"):
                call.on_response_headers(flow.response)
        elif flow.metadata.get(ROUTE, (None,))[0] == PASS:
            flow.response.stream = True  # passed through untouched, never buffered

    def response(self, flow: http.HTTPFlow) -> None:
        call: TextCall | None = flow.metadata.get(CALL)
        if call is not None:
            with _logged(flow, "response"):
                call.on_response(flow.response)
        if access_log.isEnabledFor(logging.INFO):
            self._access(flow, flow.response.status_code)

    def error(self, flow: http.HTTPFlow) -> None:
        call: TextCall | None = flow.metadata.get(CALL)
        with _logged(flow, "error"):
            if call is not None:
                call.on_error(flow)
            elif self.text is not None and flow.response is None:
                kind, _ = flow.metadata.get(ROUTE, (None, None))
                if kind == MODELS and flow.error and not flow.error.msg.startswith("Client"):
                    message = f"upstream unavailable: {flow.error.msg}"
                    self.conns.respond(flow, 502, openai_error(502, message))
        if access_log.isEnabledFor(logging.INFO):
            self._access(flow, None)

    def _access(self, flow: http.HTTPFlow, status: int | None) -> None:
        kind, trajectory_id = flow.metadata.get(ROUTE, (None, None))
        if kind not in (CHAT, MODELS):
            return
        elapsed = (time.time() - flow.request.timestamp_start) * 1000.0
        outcome = str(status) if status is not None else f"error ({flow.error})"
        path = f"/t/{trajectory_id}/v1/{'chat/completions' if kind == CHAT else 'models'}"
        if flow.metadata.get(PROXIED):
            path = f"{path} (through the proxy)"
        access_log.info("%s %s %s %.1f ms", flow.request.method, path, outcome, elapsed)


def _token_call(body: bytes, t_start: float) -> dict[str, Any]:
    """What /healthz and `GET /trajectories` count of a committed token-mode reply (D-7).

    The reply is JSON, or a synthesised SSE body whose last JSON chunk carries usage and
    the finish reason (http.md §9.6-§9.7).
    """
    summary: dict[str, Any] = {"t_start": t_start, "t_end": time.time()}
    chunk: Any = None
    try:
        if body.startswith(b"{"):
            chunk = orjson.loads(body)
        else:
            events = [line for line in body.split(b"\n") if line.startswith(b"data: {")]
            chunk = orjson.loads(events[-1][6:]) if events else None
    except orjson.JSONDecodeError:
        chunk = None
    if isinstance(chunk, dict):
        summary["usage"] = chunk.get("usage")
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            summary["finish_reason"] = choices[0].get("finish_reason")
    return summary

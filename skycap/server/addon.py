"""The skycap mitmproxy addon: routes control and harness requests over one trajectory store.

It stays thin (docs/architecture.md): routing, body size and mitmproxy's lifecycle
hooks live here; the routes in `routes`, the harness routes (gate, retries) in `harness`,
running calls in the server's call mode (`textmode` or `tokenmode`), control answers in
`control`, trajectories in `store`, proxy credentials and pass-through in `proxy`. A call
captured through the proxy listener (`--proxy-port`) takes the same path as a
`/t/{id}/v1` call; only where the trajectory id comes from differs. Built either from a
ServerOptions (`skycap serve`, CaptureService) or, under `mitmdump -s addons/skycap.py`,
from the `skycap_*` options.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mitmproxy import connection, ctx, exceptions, http, tcp
from mitmproxy.proxy.mode_specs import RegularMode, ReverseMode

import skycap.control_token as credential
from skycap.certs import ensure_ca
from skycap.dialects import CALL, STORED_REPLY, Dialect, Route
from skycap.dialects import COUNT_TOKENS as COUNT_TOKENS_ACTION
from skycap.dialects import MODELS as MODELS_ACTION
from skycap.dialects.responses import DIALECT as RESPONSES_DIALECT
from skycap.server import options as options_module
from skycap.server import routes
from skycap.server.answer import Answer
from skycap.server.conns import Connections, listen_address
from skycap.server.control import ACCEPTED, CHALLENGE, MISSING, Control
from skycap.server.destinations import Destinations
from skycap.server.flowstate import FlowState, state_of
from skycap.server.frontdoor import FrontDoor
from skycap.server.harness import Harness
from skycap.server.keys import raw_header
from skycap.server.loopback import Drained, Loopback
from skycap.server.mode import CallMode, harness_error, respond
from skycap.server.options import ServerOptions
from skycap.server.proxy import Proxy, ProxyAuthRequired
from skycap.server.store import TrajectoryStore
from skycap.server.textmode import TextMode
from skycap.server.upstream import UpstreamPool
from skycap.server.websocket import ResponsesSocket, is_upgrade, open_socket
from skycap.wire import control_error

logger = logging.getLogger("skycap.server")
access_log = logging.getLogger("skycap.access")

# Route kinds: the control routes and the outcomes of routing, then the harness routes'
# (`routes.TABLE`), by the names callers match on.
HEALTH, LIST, CREATE, FINISH, DOCUMENT = "health", "list", "create", "finish", "document"
RECORD = "record"
HARNESS_MISS, MISS, OVERSIZE = "harness-miss", "miss", "oversize"
PASS, ANSWERED = "pass", "answered"  # proxy listener: not captured / refused in requestheaders
REFUSED = "refused"  # proxy listener: a model-API host's route skycap does not capture
CHAT, MESSAGES, COUNT_TOKENS, RESPONSES, RESPONSE_GET, COMPACT = (
    r.kind for d in routes.DIALECTS for r in d.routes
)
(MODELS,) = (r.kind for r in routes.SHARED)
WEBSOCKET_REFUSAL = (
    "skycap captures the Responses API over WebSocket only on a trajectory's base URL "
    "(/t/{id}/v1/responses) or through its proxy port; use one of them, or HTTPS (POST "
    "/v1/responses), which Codex falls back to on this answer"
)
#: What a route does when text mode sends it on unchanged (its failure is skycap's 502).
_FORWARDED = frozenset({COUNT_TOKENS_ACTION, MODELS_ACTION, STORED_REPLY})
# An answer larger than this is dropped once sent (mitmproxy's stream state would keep it).
LARGE_ANSWER = 1 << 20


# The control routes that name a trajectory: {(tail, method): kind}.
_TRAJECTORY_ROUTES = {("", "GET"): DOCUMENT, ("finish", "POST"): FINISH, ("record", "GET"): RECORD}


def harness_kind(kind: str | None) -> bool:
    """Whether a route's callers are harnesses (answered in a dialect's shape)."""
    return kind == HARNESS_MISS or routes.TABLE.route(kind) is not None


def route(method: str, path: str) -> tuple[str, str | None]:
    """(kind, trajectory id) for a request line; matching is exact.

    Anything else is a miss, answered 404 and never forwarded
    (docs/http.md "The HTTP contract, as built").
    """
    path = path.partition("?")[0]
    if path.startswith("/t/"):
        trajectory_id, _, tail = path[3:].partition("/")
        kind = routes.TABLE.named(method, tail)
        return (HARNESS_MISS, None) if kind is None else (kind, trajectory_id)
    if path.startswith("/trajectories/"):
        trajectory_id, _, tail = path[len("/trajectories/") :].partition("/")
        kind = _TRAJECTORY_ROUTES.get((tail, method))
        return (MISS, None) if kind is None else (kind, trajectory_id)
    if path == "/healthz" and method == "GET":
        return HEALTH, None
    if path == "/trajectories":
        return {"POST": CREATE, "GET": LIST}.get(method, MISS), None
    return MISS, None


def proxy_route(method: str, path: str, model_api_host: bool = False) -> str:
    """The kind of a request through the proxy listener.

    Model calls are captured on any host, matched by suffix so deployment paths
    (`/openai/deployments/x/chat/completions`) are captured too. Any other request to a
    model-API host is refused, never forwarded with the harness's key; other hosts pass
    through.
    """
    kind = routes.TABLE.proxied(method, path.partition("?")[0])
    if kind is not None:
        return kind
    return REFUSED if model_api_host else PASS


def dialect_of(flow: http.HTTPFlow, kind: str | None, host: str = "") -> Dialect:
    """The dialect whose shapes a harness-route caller reads: see `RouteTable`."""
    return routes.TABLE.dialect_of(kind, flow.request.headers, host)


def too_large_message(size: int, limit: int) -> str:
    return (
        f"the request body of {size} bytes is over the limit of {limit} bytes; send a smaller "
        "body or start the server with a larger --max-body-size"
    )


def _responses_websocket(flow: http.HTTPFlow) -> bool:
    """Refuse a WebSocket upgrade to a Responses path skycap does not capture (one that
    names no trajectory); true when refused.

    Codex tries the WebSocket first; a 426 makes it fall back to HTTPS at once, where a
    404 or 403 makes it retry five times first (docs/proxy.md).
    """
    request = flow.request
    if not is_upgrade(flow) or "/v1/responses" not in request.path.partition("?")[0]:
        return False
    logger.info("refused a WebSocket upgrade to %s%s", request.host, request.path)
    harness_error(flow, 426, WEBSOCKET_REFUSAL, "websocket_not_supported", RESPONSES_DIALECT)
    return True


def _websocket_kind(kind: str | None) -> bool:
    """Whether a route is also taken as a WebSocket (docs/proxy.md)."""
    harness_route = routes.TABLE.route(kind)
    return harness_route is not None and harness_route.websocket


def _refuse(flow: http.HTTPFlow, kind: str, status: int, message: str) -> None:
    """An error in the shape the route's callers read: the dialect's on harness routes."""
    if harness_kind(kind):
        harness_error(flow, status, message, None, dialect_of(flow, kind))
    else:
        respond(flow, status, control_error(message))


def _release_request_body(flow: http.HTTPFlow) -> None:
    """Drop a request body nothing needs any more: it has been forwarded or answered.

    mitmproxy's own per-request state holds the flow in a reference cycle (its stream's
    state is a bound method), so without this a 200 MB request would stay resident until
    the garbage collector happens to run. Large answers are dropped the same way once
    sent: at the connection's next HTTP/1 request or when it closes.
    """
    if flow.request.data.content:
        flow.request.data.content = b""


@contextlib.contextmanager
def _logged(flow: http.HTTPFlow, hook: str) -> Iterator[None]:
    """A bug in a response-side hook is logged as a warning, never shown as a traceback."""
    try:
        yield
    except Exception as exc:
        logger.warning("%s hook for %s failed: %r", hook, flow.request.path, exc)
        logger.debug("traceback", exc_info=True)


class SkycapAddon:
    """One capture server as a mitmproxy addon. Pass `options` unless mitmdump supplies them."""

    def __init__(self, options: ServerOptions | None = None) -> None:
        self._from_script = options is None
        self.token_file: Path | None = None
        #: Whether the server is up: until then `/healthz` answers 503 `starting`, so that
        #: whoever polls it finds the control token file once it says ok.
        self.up = False
        self.options: ServerOptions | None = None
        self.store: TrajectoryStore | None = None
        self.mode: CallMode | None = None
        self.running_loop: asyncio.AbstractEventLoop | None = None
        #: The base-URL port, once listening.
        self.port = 0
        self.conns = Connections()
        self.proxy: Proxy | None = None
        # client connection id -> flows with a large answer that may still be being sent
        self._answered: dict[str, list[weakref.ref[http.HTTPFlow]]] = {}
        if options is not None:
            self._build(options)

    def _build(self, options: ServerOptions) -> None:
        self.options = options
        #: Where flows whose answer is written over time are re-targeted to.
        self.loopback = Loopback()
        #: Reads the loopback's answers to calls that came as WebSocket messages.
        self.socket_reader = UpstreamPool(None)
        mode: CallMode
        if options.mode == "tokens":
            from skycap.server.tokenmode import TokenMode

            mode = TokenMode(options, self.loopback)
        else:
            mode = TextMode(options, self.conns, self.loopback)
        self.mode = mode
        self.store = TrajectoryStore(
            options,
            mode.capture,
            release=mode.release,
            decode_spans=mode.decode_spans,
            provenance=mode.provenance,
            counters=mode.counters,
        )
        mode.attach(self.store)
        if options.proxy_port is not None:
            destinations = Destinations(options.allow_rules, options.deny_rules)
            self.proxy = Proxy(
                self.store, ensure_ca(options.confdir), destinations, options.model_api_hosts
            )
        self.control = Control(self.store, self.proxy, options.control_token)
        self.harness = Harness(options, self.store, mode)

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
        except (ValueError, TypeError, ImportError) as exc:
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
        await self.loopback.start()
        await self.store.recover()
        self.store.start()
        assert self.options is not None and self.mode is not None
        await self.mode.start()
        if not self._from_script:
            return  # `runner.serve` listens on the base-URL port and calls `started`
        try:
            self.port = listen_address(proxyserver, ReverseMode)[1]
        except LookupError:  # the listener failed to bind: whoever started mitmproxy says so
            return
        if not self.options.no_control_token:
            path = self.publish_token(self.port, default=True)
            logger.warning("skycap: the control token is in %s", path)
        self.started()

    def attach_front_door(self, front: FrontDoor, port: int) -> None:
        """`runner.serve` answers the base-URL port with `front` (`frontdoor.py`)."""
        self.conns.attach_front_door(front)
        front.answer_locally(self.loopback.take)
        assert self.options is not None
        front.limit_bodies(self.options.max_body_size, self._oversize)
        self.port = port

    def _oversize(self, flow: http.HTTPFlow, size: int) -> None:
        """A chunked body the front door read past `--max-body-size`: 413, none of it kept."""
        assert self.options is not None
        limit = self.options.max_body_size
        _refuse(flow, state_of(flow).kind or MISS, 413, too_large_message(size, limit))

    def started(self) -> None:
        """The server is up: started, with its control token published where it goes."""
        assert self.options is not None
        if self.options.no_control_token:
            logger.warning(
                "the control token is off (--no-control-token): anyone who can reach port %s, "
                "a harness included, can create, list, read and finish trajectories",
                self.port,
            )
        self.up = True

    def publish_token(self, port: int, *, default: bool) -> Path | None:
        """Write the control token to `control_token_file` (or, with `default`, to the default
        file for `port`); the path written, None when there is no file to write.

        Raises OSError naming the path when it cannot be written.
        """
        assert self.options is not None
        token, path = self.options.control_token, self.options.control_token_file
        if path is None and default:
            path = credential.default_token_file(port)
        if token is None or path is None:
            return None
        try:
            credential.write_token_file(path, token)
        except OSError as exc:
            raise OSError(
                f"cannot write the control token to {path}: {exc.strerror or exc}; pass "
                "--control-token-file PATH (control_token_file=) with a writable path"
            ) from None
        self.token_file = path
        return path

    def close_to_calls(self) -> None:
        """Shutdown's first step, before connections close: no trajectory takes calls."""
        if self.store is not None and self.running_loop is not None:
            self.store.close_to_calls()

    async def done(self) -> None:
        if self.store is None or self.running_loop is None:
            return
        await self.store.shutdown()
        if self.token_file is not None and self.options is not None:
            credential.remove_token_file(self.token_file, self.options.control_token or "")
        if self.mode is not None:
            await self.mode.close()
        self.socket_reader.close()
        await self.loopback.close()

    # -- proxy listener --------------------------------------------------------------------------

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """CONNECT names the tunnel's trajectory; mitmproxy refuses it in reverse mode."""
        if self.proxy is not None and self.proxy.serves(flow):
            self.proxy.connect(flow)

    def client_disconnected(self, client: connection.Client) -> None:
        if self.proxy is not None:
            self.proxy.forget(client.id)
        self._release_answered(client.id)

    def _release_answered(self, client_id: str) -> None:
        """Drop the large answers already sent on a connection (see `_release_request_body`)."""
        for ref in self._answered.pop(client_id, ()):
            flow = ref()
            if flow is not None and flow.response is not None:
                flow.response.data.content = b""

    async def tcp_start(self, flow: tcp.TCPFlow) -> None:
        """A tunnel mitmproxy relays as raw TCP: only within the proxy's limits."""
        if self.proxy is not None and self.proxy.serves(flow):
            await self.proxy.tcp_start(flow)

    async def _proxy_route(self, flow: http.HTTPFlow) -> tuple[str, str | None]:
        """Route a request on the proxy listener; a refusal or a pass-through is settled here."""
        assert self.proxy is not None
        try:
            trajectory_id = self.proxy.trajectory_of(flow)
        except ProxyAuthRequired as refused:
            flow.response = refused.response()
            return ANSWERED, None
        method = flow.request.method
        if is_upgrade(flow):
            kind = routes.TABLE.proxied("POST", flow.request.path.partition("?")[0])
            if _websocket_kind(kind):
                state = state_of(flow)
                state.proxied = state.websocket = True
                return kind, trajectory_id
            if _responses_websocket(flow):
                return ANSWERED, trajectory_id
        kind = proxy_route(method, flow.request.path, self.proxy.model_api_host(flow.request.host))
        if kind == REFUSED:
            dialect = dialect_of(flow, kind, flow.request.host)
            self.proxy.refuse(flow, trajectory_id, dialect)
            return ANSWERED, trajectory_id
        if kind == PASS:
            await self.proxy.pass_through(flow, trajectory_id)
            return (ANSWERED if flow.response is not None else PASS), trajectory_id
        state_of(flow).proxied = True
        return kind, trajectory_id

    # -- request hooks -------------------------------------------------------------------------

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Route once; send a body announced as oversize to the drain sink, unread."""
        if self._answered and not (flow.request.is_http2 or flow.request.is_http3):
            self._release_answered(flow.client_conn.id)  # HTTP/1: earlier answers are sent
        if self.proxy is not None and self.proxy.serves(flow):
            kind, trajectory_id = await self._proxy_route(flow)
        elif is_upgrade(flow):
            kind, trajectory_id = route("POST", flow.request.path)
            if _websocket_kind(kind):
                state_of(flow).websocket = True
            elif _responses_websocket(flow):
                kind, trajectory_id = ANSWERED, None
            else:
                kind, trajectory_id = route(flow.request.method, flow.request.path)
        else:
            kind, trajectory_id = route(flow.request.method, flow.request.path)
        state = state_of(flow)
        state.kind, state.trajectory_id = kind, trajectory_id
        if kind == PASS or kind == ANSWERED:
            return
        length = raw_header(flow.request.data.headers.fields, b"content-length")
        assert self.options is not None
        if length and length.isdigit() and int(length) > self.options.max_body_size:
            message = too_large_message(int(length), self.options.max_body_size)
            if harness_kind(kind):
                body = dialect_of(flow, kind).error(413, message)
            else:
                body = control_error(message)
            state.kind, state.trajectory_id = OVERSIZE, None
            self.loopback.retarget(flow, Drained(body), body=True)
            flow.request.stream = True

    async def request(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        if state.kind is None:
            state.kind, state.trajectory_id = route(flow.request.method, flow.request.path)
        kind, trajectory_id = state.kind, state.trajectory_id
        if kind == OVERSIZE or kind == PASS or kind == ANSWERED:
            return
        try:
            await self._dispatch(flow, state, kind, trajectory_id)
        except Exception as exc:  # answer, never fall through to the reverse target
            logger.warning("%s %s failed: %r", flow.request.method, flow.request.path, exc)
            logger.debug("traceback", exc_info=True)
            _refuse(flow, kind, 500, f"internal error: {type(exc).__name__}: {exc}")

    async def _dispatch(
        self, flow: http.HTTPFlow, state: FlowState, kind: str, trajectory_id: str | None
    ) -> None:
        raw = flow.request.raw_content or b""
        assert self.options is not None and self.store is not None
        if kind == HEALTH and not self.up:
            respond(flow, 503, b'{"ok":false,"starting":true}')
            return
        if kind != HEALTH and not self.store.replayed.is_set():  # /healthz answers meanwhile
            await self.store.replayed.wait()
        harness_route = routes.TABLE.route(kind)
        if len(raw) > self.options.max_body_size:
            _refuse(flow, kind, 413, too_large_message(len(raw), self.options.max_body_size))
        elif harness_route is not None:
            assert trajectory_id is not None
            await self._harness(flow, state, harness_route, trajectory_id, raw)
        elif kind == HARNESS_MISS:
            path = flow.request.path.partition("?")[0]
            message = f"no route {flow.request.method} {path}"
            harness_error(flow, 404, message, None, dialect_of(flow, kind))
        elif kind == MISS:
            path = flow.request.path.partition("?")[0]
            respond(flow, 404, control_error(f"no route {flow.request.method} {path}"))
        else:
            verdict = self.control.credential(flow.request.headers.fields)
            if verdict == ACCEPTED:
                answer = await self._control(flow, kind, trajectory_id, raw)
            elif kind == HEALTH and verdict == MISSING:
                answer = self.control.liveness()
            else:
                status, body = self.control.refusal(verdict)
                if status == 401:
                    respond(flow, status, body, CHALLENGE)
                else:
                    respond(flow, status, body)
                return
            respond(flow, answer.status, answer.body)
            state.sent = answer.sent

    async def _harness(
        self, flow: http.HTTPFlow, state: FlowState, route: Route, trajectory_id: str, raw: bytes
    ) -> None:
        """A harness route, by what it does (`routes.TABLE`)."""
        proxied, dialect = state.proxied, dialect_of(flow, route.kind)
        suffix = b"/" + route.tail.encode()  # where text mode forwards it, after the base URL
        if state.websocket:
            await self._open_websocket(flow, state, trajectory_id, dialect)
        elif route.action == CALL:
            state.call = await self.harness.call(flow, trajectory_id, proxied, raw, dialect)
        elif route.action == COUNT_TOKENS_ACTION:
            await self.harness.count_tokens(flow, trajectory_id, proxied, raw, suffix, dialect)
        elif route.action == MODELS_ACTION:
            await self.harness.models(flow, trajectory_id, proxied, suffix, dialect)
        else:
            assert route.action == STORED_REPLY
            reply_id = flow.request.path.partition("?")[0].rpartition("/")[2]
            suffix += reply_id.encode()
            await self.harness.stored_reply(flow, trajectory_id, proxied, reply_id, suffix, dialect)

    async def _open_websocket(
        self, flow: http.HTTPFlow, state: FlowState, trajectory_id: str, dialect: Dialect
    ) -> None:
        """A captured WebSocket: the gate once for the connection, then a session whose
        messages are calls (`websocket.py`); a refusal is the handshake's HTTP answer."""
        if await self.harness.admit(flow, trajectory_id, state.proxied, dialect) is None:
            return
        assert self.options is not None

        def send(message: bytes) -> None:
            ctx.master.commands.call("inject.websocket", flow, True, message, True)

        state.socket = ResponsesSocket(
            flow,
            harness=self.harness,
            loopback=self.loopback,
            reader=self.socket_reader,
            trajectory_id=trajectory_id,
            proxied=state.proxied,
            dialect=dialect,
            max_body_size=self.options.max_body_size,
            send=send,
            drop=lambda: self.conns.drop(flow),
        )
        open_socket(flow, self.loopback)

    async def _control(
        self, flow: http.HTTPFlow, kind: str, trajectory_id: str | None, raw: bytes
    ) -> Answer:
        if kind == HEALTH:
            return self.control.health()
        if kind == CREATE:
            return self.control.create(raw, self._origin(flow))
        if kind == LIST:
            return self.control.listing(flow.request.query.get("ended"))
        if kind == FINISH:
            assert trajectory_id is not None
            return await self.control.finish(trajectory_id, raw)
        if kind == RECORD:
            assert trajectory_id is not None
            return self.control.record(trajectory_id)
        assert kind == DOCUMENT and trajectory_id is not None
        return await self.control.document(trajectory_id)

    def _origin(self, flow: http.HTTPFlow) -> str:
        """Where the caller reached us: the Host header if mitmproxy kept it."""
        scheme = "https" if flow.client_conn.tls_established else "http"
        host = flow.request.host_header if ctx.options.keep_host_header else None
        if not host:
            address, port = flow.client_conn.sockname[:2]
            host = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        return f"{scheme}://{host}"

    # -- response hooks (text mode) ------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        if state.close_after:
            flow.response.headers["connection"] = "close"  # mitmproxy then closes it
        if state.call is not None and state.call.relaying:
            flow.response.stream = True  # a reply relayed from the upstream, passed on as it comes
        elif state.kind == PASS:
            flow.response.stream = True  # passed through untouched, never buffered
        elif state.streamed:
            flow.response.stream = True  # a token-mode reply, sent as it is generated
            flow.response.headers.pop("connection", None)

    def response(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        if (sent := state.sent) is not None:
            state.sent = None
            # mitmproxy writes the answer when this hook returns, in the same loop step.
            asyncio.get_running_loop().call_soon(sent)
        _release_request_body(flow)
        if len(flow.response.data.content or b"") > LARGE_ANSWER:
            self._answered.setdefault(flow.client_conn.id, []).append(weakref.ref(flow))
        if access_log.isEnabledFor(logging.INFO):
            self._access(flow, flow.response.status_code)

    # -- WebSocket hooks (a captured Responses WebSocket) ---------------------------------------

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """A client message is a call for the session, never relayed to the sink; what the
        session injects goes on to the harness. None is kept on the flow."""
        socket = state_of(flow).socket
        assert flow.websocket is not None
        if socket is not None:
            message = flow.websocket.messages[-1]
            if message.from_client and not message.injected:
                message.drop()
                socket.receive(message.content)
        flow.websocket.messages.clear()

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        if (socket := state_of(flow).socket) is not None:
            socket.close()

    def error(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        if state.socket is not None:
            state.socket.close()
        with _logged(flow, "error"):
            if state.call is not None:
                state.call.harness_left()
            elif self.mode is not None:
                harness_route = routes.TABLE.route(state.kind)
                forwarded = harness_route is not None and harness_route.action in _FORWARDED
                self.mode.harness_left(flow, forwarded, dialect_of(flow, state.kind))
        if (sent := state.sent) is not None:
            state.sent = None
            sent()  # the caller is gone: nothing left to wait for
        _release_request_body(flow)
        if access_log.isEnabledFor(logging.INFO):
            self._access(flow, None)

    def _access(self, flow: http.HTTPFlow, status: int | None) -> None:
        state = state_of(flow)
        harness_route = routes.TABLE.route(state.kind)
        if harness_route is None:
            return
        elapsed = (time.time() - flow.request.timestamp_start) * 1000.0
        outcome = str(status) if status is not None else f"error ({flow.error})"
        path = f"/t/{state.trajectory_id}/v1/{harness_route.access_tail}"
        if state.proxied:
            path = f"{path} (through the proxy)"
        access_log.info("%s %s %s %.1f ms", flow.request.method, path, outcome, elapsed)

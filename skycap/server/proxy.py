"""The HTTPS_PROXY listener's state: which trajectory each proxy client is, and what passed by.

A harness that cannot change its base URL runs with `HTTPS_PROXY=http://<id>:<key>@host:port`
and `SSL_CERT_FILE=<bundle>` (the `env` that `POST /trajectories` returns). skycap, not
mitmproxy's `proxyauth` addon, owns the credential check, so refusals carry skycap's own
messages:

* at CONNECT, missing, malformed, unknown or wrong credentials get 407 with
  `Proxy-Authenticate: Basic realm="skycap"`; the key is always checked, whatever
  `--require-api-key` says;
* an ended trajectory's tunnel is accepted (http.md §3 checks "ended" before the key, and
  a trajectory read back from disk has no key), and its calls get 410 `trajectory_closed`;
* a plain-HTTP request in absolute form (no CONNECT) carries its own credentials and is
  checked the same way, request by request.

Inside a tunnel, model calls (Chat Completions, Anthropic Messages and its count_tokens,
model lists) are captured by the addon exactly like `/t/{id}/v1` calls, on any host. Any
other request to a model-API host (`--model-api-host`) is refused in the caller's
error shape and never forwarded with the harness's key; everything else passes through
unchanged (streamed both ways, never buffered). Refusals and pass-throughs are each an
`info` line and a per-host count in /healthz. Passing through needs an open trajectory, so
an ended trajectory's id, which is no secret, never turns skycap into an open relay; and it
never reaches loopback or link-local addresses unless `--proxy-allow` says so (its
`destinations`). A tunnel that carries something other than HTTP (raw TCP) obeys the
same two rules.
"""

from __future__ import annotations

import collections
import fnmatch
import hmac
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import http, tcp
from mitmproxy.proxy.mode_specs import RegularMode

from skycap.certs import CertAuthority
from skycap.dialects import Dialect
from skycap.dialects.chat import openai_error
from skycap.server.destinations import Destinations
from skycap.server.keys import basic_credentials, raw_header
from skycap.server.live import Live
from skycap.server.store import UNKNOWN, TrajectoryStore
from skycap.trajectory import is_trajectory_id

logger = logging.getLogger("skycap.server")

REALM = 'Basic realm="skycap"'
_JSON = "application/json"
MISSING = (
    "proxy credentials are missing: run the harness with the env (HTTPS_PROXY) that "
    "POST /trajectories returned"
)
MALFORMED = "Proxy-Authorization must be Basic base64(<trajectory id>:<api_key>)"
WRONG_KEY = "wrong api_key for trajectory"
CLOSED_PASS = "trajectory has ended; its proxy no longer forwards other traffic"


class ProxyAuthRequired(Exception):
    """Credentials that name no open trajectory with its key: the answer is a 407."""

    def response(self) -> http.Response:
        message = str(self)
        response = http.Response.make(
            407,
            openai_error(407, message, "proxy_auth_required"),
            {"content-type": _JSON, "proxy-authenticate": REALM},
        )
        # httpx shows only the status line of a refused CONNECT: put the reason there too.
        response.reason = f"Proxy Authentication Required ({message})"
        return response


def _credentials(flow: http.HTTPFlow) -> bytes | None:
    return raw_header(flow.request.headers.fields, b"proxy-authorization")


class Proxy:
    """Credentials, tunnels and pass-through counts for the proxy listener (one per server)."""

    def __init__(
        self,
        store: TrajectoryStore,
        ca: CertAuthority,
        destinations: Destinations,
        model_api_hosts: Sequence[str] = (),
    ) -> None:
        self.store = store
        self.ca = ca
        self.destinations = destinations
        self.model_api_hosts = tuple(model_api_hosts)
        self.refused: collections.Counter[str] = collections.Counter()
        self.port: int | None = None  # the bound port, known once the listener runs
        self._tunnels: dict[str, str] = {}  # client connection id -> trajectory id
        self.passed_through: collections.Counter[str] = collections.Counter()

    @staticmethod
    def serves(flow: http.HTTPFlow | tcp.TCPFlow) -> bool:
        """Whether the flow came in on the proxy listener (not the control/harness one)."""
        return isinstance(flow.client_conn.proxy_mode, RegularMode)

    # -- credentials -------------------------------------------------------------------------

    def identify(self, header: bytes | None) -> str:
        """The trajectory id that `Proxy-Authorization` names; raises ProxyAuthRequired.

        An open trajectory needs its key (constant-time compare); an ended one is named
        by its id alone (its calls then get 410, never a silent pass).
        """
        if not header:
            raise ProxyAuthRequired(MISSING)
        credentials = basic_credentials(header)
        if credentials is None:
            raise ProxyAuthRequired(MALFORMED)
        user, password = credentials
        trajectory_id = user.decode("ascii", "replace")
        if not is_trajectory_id(trajectory_id):
            raise ProxyAuthRequired(UNKNOWN)
        live = self.store.get(trajectory_id)
        if live is None:
            if self.store.records.on_disk(trajectory_id):
                return trajectory_id
            raise ProxyAuthRequired(f"{UNKNOWN} {trajectory_id}")
        if live.trajectory.is_open and not hmac.compare_digest(password, live.api_key):
            raise ProxyAuthRequired(f"{WRONG_KEY} {trajectory_id}")
        return trajectory_id

    def connect(self, flow: http.HTTPFlow) -> None:
        """The `http_connect` hook: remember the tunnel's trajectory, or answer 407."""
        try:
            trajectory_id = self.identify(_credentials(flow))
        except ProxyAuthRequired as refused:
            flow.response = refused.response()
            return
        self._tunnels[flow.client_conn.id] = trajectory_id

    def trajectory_of(self, flow: http.HTTPFlow) -> str:
        """A request's trajectory: its tunnel's, else its own credentials (absolute form).

        `Proxy-Authorization` is removed either way: the key never leaves skycap.
        """
        header = _credentials(flow)
        if header is not None:
            del flow.request.headers["proxy-authorization"]
        tunnel = self._tunnels.get(flow.client_conn.id)
        return tunnel if tunnel is not None else self.identify(header)

    def forget(self, client_id: str) -> None:
        """The client connection closed: its tunnel names nothing any more."""
        self._tunnels.pop(client_id, None)

    # -- traffic that is not captured ----------------------------------------------------------

    def model_api_host(self, host: str) -> bool:
        """Whether `host` is a model-API host: its uncaptured routes are refused."""
        host = host.lower().rstrip(".")
        return any(fnmatch.fnmatchcase(host, pattern) for pattern in self.model_api_hosts)

    def refuse(self, flow: http.HTTPFlow, trajectory_id: str, dialect: Dialect) -> None:
        """Answer an uncaptured route of a model-API host: 403, never forwarded."""
        request = flow.request
        route = f"{request.method} {request.host}{request.path.partition('?')[0]}"
        self.refused[request.host] += 1
        logger.info("proxy: refused %s for %s: not a captured model route", route, trajectory_id)
        message = (
            f"skycap does not capture {route}: on a model-API host only model calls "
            "(chat/completions, v1/messages, v1/messages/count_tokens, v1/responses, models) are "
            "captured, and any other route is refused rather than forwarded with the "
            "harness's key"
        )
        flow.response = http.Response.make(
            403, dialect.error(403, message, "route_not_captured"), {"content-type": _JSON}
        )

    async def pass_through(self, flow: http.HTTPFlow, trajectory_id: str) -> None:
        """Stream a request the harness makes beside its model calls, unchanged; count its host.

        An ended trajectory's proxy forwards nothing more: 410 `trajectory_closed`; a
        destination on this machine is 403 `destination_refused`.
        """
        live = self.store.get(trajectory_id)
        if live is None or not live.trajectory.is_open:
            flow.response = http.Response.make(
                410, openai_error(410, CLOSED_PASS, "trajectory_closed"), {"content-type": _JSON}
            )
            return
        refusal = await self.destinations.refusal(flow.request.host, flow.request.port)
        if refusal is not None:
            self.refused[flow.request.host] += 1
            flow.response = http.Response.make(
                403, openai_error(403, refusal, "destination_refused"), {"content-type": _JSON}
            )
            return
        live.touch()
        self.passed_through[flow.request.host] += 1
        logger.info(
            "proxy: passed through %s %s for %s",
            flow.request.method,
            flow.request.host,
            trajectory_id,
        )
        flow.request.stream = True

    async def tcp_start(self, flow: tcp.TCPFlow) -> None:
        """A tunnel that is not HTTP: relayed only for an open trajectory to an allowed host."""
        trajectory_id = self._tunnels.get(flow.client_conn.id)
        live = self.store.get(trajectory_id) if trajectory_id is not None else None
        host, port = flow.server_conn.address or ("", 0)
        if live is None or not live.trajectory.is_open:
            flow.kill()
            return
        if await self.destinations.refusal(host, port) is not None:
            self.refused[host] += 1
            flow.kill()
            return
        live.touch()
        self.passed_through[host] += 1

    # -- what the control routes report --------------------------------------------------------

    def env(self, live: Live, origin: str) -> dict[str, Any]:
        """`proxy_url` and the harness `env` a create returns, for the host the trainer used."""
        host = urlsplit(origin).hostname or "127.0.0.1"
        authority = f"[{host}]" if ":" in host else host
        proxy_url = f"http://{live.id}:{live.api_key.decode('ascii')}@{authority}:{self.port}"
        return {
            "proxy_url": proxy_url,
            "env": {
                "HTTPS_PROXY": proxy_url,
                "SSL_CERT_FILE": str(self.ca.bundle),
                # Node (Claude Code, the Node SDKs) and Codex read their own names.
                "NODE_EXTRA_CA_CERTS": str(self.ca.bundle),
                "NODE_USE_ENV_PROXY": "1",
                "CODEX_CA_CERTIFICATE": str(self.ca.bundle),
                "NO_PROXY": host,
            },
        }

    def health(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "ca_bundle": str(self.ca.bundle),
            "passed_through": dict(self.passed_through),
            "refused": dict(self.refused),
        }

"""What `skycap top` knows of each capture server: polled from its control routes over HTTP.

It reads only `GET /healthz`, `GET /trajectories` (live rows), `GET /trajectories?ended=recent`
(the ring of recently ended trajectories) and, for the detail view, `GET /trajectories/{id}`,
with the control token, so it works against any skycap server and never imports mitmproxy.
Rates come from the cumulative counters of two consecutive polls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from skycap.control_token import find_control_token


@dataclass
class ServerState:
    """One server's last answers and the rates derived from its counters."""

    url: str
    up: bool = False
    error: str | None = None
    health: dict[str, Any] = field(default_factory=dict)
    trajectories: list[dict[str, Any]] = field(default_factory=list)
    recent: list[dict[str, Any]] = field(default_factory=list)
    calls_per_s: float | None = None
    tokens_per_s: float | None = None
    _last: tuple[float, int, int] | None = None

    def update(
        self,
        health: dict[str, Any],
        trajectories: list[dict[str, Any]],
        recent: list[dict[str, Any]],
    ) -> None:
        now = time.monotonic()
        calls, tokens = int(health.get("calls_total") or 0), int(health.get("tokens_total") or 0)
        if self._last is not None and now > self._last[0]:
            elapsed = now - self._last[0]
            self.calls_per_s = max(0, calls - self._last[1]) / elapsed
            self.tokens_per_s = max(0, tokens - self._last[2]) / elapsed
        self._last = (now, calls, tokens)
        self.up, self.error, self.health = True, None, health
        self.trajectories, self.recent = trajectories, recent

    def mark_down(self, error: str) -> None:
        self.up, self.error = False, error
        self.calls_per_s = self.tokens_per_s = None
        self._last = None

    @property
    def mode(self) -> str:
        return str((self.health.get("capture") or {}).get("mode", "?"))


class Poller:
    """Polls every server once per `poll()`; a server that fails is shown as down.

    `control_token` is sent as `Authorization: Bearer` to every server; without it each
    server gets the token found for it (`find_control_token`).
    """

    def __init__(
        self, urls: list[str], *, timeout: float = 2.0, control_token: str | None = None
    ) -> None:
        self.servers = [ServerState(url.rstrip("/")) for url in urls]
        self._client = httpx.Client(timeout=timeout, trust_env=False)
        self.control_token = control_token

    def poll(self) -> None:
        self._poll_each(self.servers)
        self._poll_each(self._add_siblings())

    def _add_siblings(self) -> list[ServerState]:
        """Add the other workers of a `skycap serve --workers N` a polled server names."""
        known = {server.url for server in self.servers}
        added: list[ServerState] = []
        for server in list(self.servers):
            ports = (server.health.get("workers") or {}).get("ports") or []
            parts = urlsplit(server.url)
            for port in ports:
                host = parts.hostname or ""
                host = f"[{host}]" if ":" in host else host
                url = f"{parts.scheme}://{host}:{port}"
                if url not in known:
                    known.add(url)
                    added.append(ServerState(url))
        self.servers += added
        return added

    def _poll_each(self, servers: list[ServerState]) -> None:
        for server in servers:
            try:
                health = self._get_json(f"{server.url}/healthz")
                listing = self._get_json(f"{server.url}/trajectories")
                recent = self._get_json(f"{server.url}/trajectories?ended=recent")
            except (httpx.HTTPError, ValueError) as exc:
                server.mark_down(describe(exc))
                continue
            server.update(health, listing, recent)

    def document(self, server: ServerState, trajectory_id: str) -> dict[str, Any] | str:
        """The trajectory's document (live or as recorded), or why it cannot be read."""
        try:
            return self._get_json(f"{server.url}/trajectories/{trajectory_id}")
        except (httpx.HTTPError, ValueError) as exc:
            return describe(exc)

    def _get_json(self, url: str) -> Any:
        """GET with the control token: the one given, else the one found for that server."""
        token = self.control_token or find_control_token(url)
        headers = {"authorization": f"Bearer {token}"} if token else None
        response = self._client.get(url, headers=headers)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._client.close()


def describe(exc: Exception) -> str:
    """A short reason for a failed poll, as the dashboard shows it."""
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        if status in (401, 403):
            return f"HTTP {status}: control token refused or missing (--control-token-env NAME)"
        return f"HTTP {status}"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, httpx.ConnectError):
        return "connection refused"
    return f"{type(exc).__name__}: {exc}"

"""The live dashboard behind `skycap top`: polls capture servers and draws rich tables.

It reads only `GET /healthz` and `GET /trajectories` (D-7), with the control token, so it
works against any skycap server and never imports mitmproxy. Rates come from the
cumulative counters of two consecutive polls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from skycap.control_token import find_control_token

SORT_KEYS = {
    "a": ("age", lambda t: t.get("age_s") or 0.0),
    "c": ("calls", lambda t: t.get("calls") or 0),
    "n": ("nodes", lambda t: t.get("nodes") or 0),
    "p": ("paths", lambda t: t.get("paths") or 0),
    "u": ("unbridged", lambda t: t.get("unbridged_calls") or 0),
    "f": ("failures", lambda t: t.get("failures") or 0),
    "l": ("latency", lambda t: (t.get("last_call") or {}).get("latency_ms") or 0.0),
}
DEFAULT_SORT = "a"


@dataclass
class ServerState:
    """What the dashboard knows of one server: its last answers and the derived rates."""

    url: str
    up: bool = False
    error: str | None = None
    health: dict[str, Any] = field(default_factory=dict)
    trajectories: list[dict[str, Any]] = field(default_factory=list)
    calls_per_s: float | None = None
    tokens_per_s: float | None = None
    _last: tuple[float, int, int] | None = None

    def update(self, health: dict[str, Any], trajectories: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        calls, tokens = int(health.get("calls_total") or 0), int(health.get("tokens_total") or 0)
        if self._last is not None and now > self._last[0]:
            elapsed = now - self._last[0]
            self.calls_per_s = max(0, calls - self._last[1]) / elapsed
            self.tokens_per_s = max(0, tokens - self._last[2]) / elapsed
        self._last = (now, calls, tokens)
        self.up, self.error, self.health, self.trajectories = True, None, health, trajectories

    def mark_down(self, error: str) -> None:
        self.up, self.error = False, error
        self.calls_per_s = self.tokens_per_s = None
        self._last = None


class Poller:
    """Polls every server once per `poll()`; a server that fails is shown as down."""

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
            except (httpx.HTTPError, ValueError) as exc:
                server.mark_down(_describe(exc))
                continue
            server.update(health, listing)

    def _get_json(self, url: str) -> Any:
        """GET with the control token: the one given, else the one found for that server."""
        token = self.control_token or find_control_token(url)
        headers = {"authorization": f"Bearer {token}"} if token else None
        response = self._client.get(url, headers=headers)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._client.close()


def _describe(exc: Exception) -> str:
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


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds / 3600:.0f}h{seconds % 3600 / 60:02.0f}m"


def servers_table(servers: list[ServerState]) -> Table:
    table = Table(
        title="capture servers",
        title_justify="left",
        expand=True,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("server", no_wrap=True)
    table.add_column("state", no_wrap=True)
    for column in ("open", "calls/s", "tok/s", "fail"):
        table.add_column(column, justify="right", no_wrap=True)
    for server in servers:
        if not server.up:
            state = Text(f"down: {server.error}", style="bold red")
            table.add_row(server.url, state, "-", "-", "-", "-")
            continue
        health = server.health
        mode = (health.get("capture") or {}).get("mode", "?")
        failures = int(health.get("failures_total") or 0)
        table.add_row(
            server.url,
            Text(f"up, {mode} mode", style="green"),
            str(health.get("open_trajectories", "-")),
            _rate(server.calls_per_s),
            _rate(server.tokens_per_s) if mode == "tokens" else "-",
            Text(str(failures), style="red" if failures else ""),
        )
    return table


def _cell(value: int, style: str) -> Text:
    return Text(str(value), style=style if value else "")


def trajectories_table(servers: list[ServerState], sort: str = DEFAULT_SORT) -> Table:
    label, key = SORT_KEYS[sort]
    rows = [(server, t) for server in servers if server.up for t in server.trajectories]
    rows.sort(key=lambda pair: key(pair[1]), reverse=True)
    # A compact box so an 80-column terminal still shows whole trajectory ids.
    table = Table(
        title=f"live trajectories ({len(rows)}), sorted by {label}",
        title_justify="left",
        expand=True,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("id", no_wrap=True, min_width=19)
    for column in ("task", "step", "status"):
        table.add_column(column, overflow="ellipsis", no_wrap=True)
    for column in ("age", "calls", "nodes", "paths", "unbr", "fail", "ms"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("finish", overflow="ellipsis", no_wrap=True)
    for server, t in rows:
        meta = t.get("meta") or {}
        last = t.get("last_call") or {}
        paths = int(t.get("paths") or 0)
        latency = last.get("latency_ms")
        table.add_row(
            str(t.get("id", "?")) + ("" if len(servers) == 1 else f" @{server.url}"),
            str(meta.get("task", meta.get("task_id", "-"))),
            str(meta.get("step", "-")),
            Text(str(t.get("status", "?")), style="" if t.get("status") == "open" else "red"),
            _age(t.get("age_s")),
            str(t.get("calls", 0)),
            str(t.get("nodes", 0)),
            Text(str(paths), style="yellow" if paths > 1 else ""),
            _cell(int(t.get("unbridged_calls") or 0), "magenta"),
            _cell(int(t.get("failures") or 0), "bold red"),
            "-" if latency is None else f"{latency:,.0f}",
            str(last.get("finish_reason") or "-"),
        )
    return table


def render(servers: list[ServerState], sort: str = DEFAULT_SORT, *, footer: bool = True) -> Group:
    parts: list[Any] = [servers_table(servers), trajectories_table(servers, sort)]
    if footer:
        keys = "  ".join(f"{k}={label}" for k, (label, _) in SORT_KEYS.items())
        parts.append(Text(f"sort: {keys}   q=quit", style="dim"))
    return Group(*parts)

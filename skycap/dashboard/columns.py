"""The columns of `skycap top`'s tables (live, recently ended, servers) and the total row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from skycap.dashboard.entries import Entry, step_of, task_of
from skycap.dashboard.layout import Column, compact, count, duration
from skycap.dashboard.poll import ServerState

#: Seconds without a call after which a live trajectory's idle time is shown in yellow.
IDLE_WARN_S = 60.0


def _failure_style(entry: Entry) -> str:
    return "bold red" if entry.row.get("failures") else ""


def _status_style(entry: Entry) -> str:
    status = entry.row.get("status")
    return {"open": "", "finished": "green", "abandoned": "yellow"}.get(str(status), "red")


def _idle_style(entry: Entry) -> str:
    return "yellow" if (entry.row.get("idle_s") or 0.0) >= IDLE_WARN_S else ""


def _last_error(entry: Entry) -> str:
    failure = entry.row.get("last_failure")
    return str(failure.get("message", "")) if isinstance(failure, dict) else ""


def _reward(entry: Entry) -> str:
    reward = (entry.row.get("annotations") or {}).get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return "-" if reward is None else str(reward)
    return f"{reward:g}"


def _record(entry: Entry) -> str:
    record = entry.row.get("record")
    if not isinstance(record, dict):
        return "memory"
    return str(record.get("mirror") or record.get("path") or "?")


def _common_columns(servers: int) -> list[Column]:
    columns = [Column("id", lambda e: e.id, 1)]
    if servers > 1:
        columns.append(Column("srv", lambda e: str(e.number), 1, right=True))
    columns += [
        Column("status", lambda e: str(e.row.get("status", "?")), 1, style=_status_style),
        Column("task", task_of, 3, flex=True, min_width=12),
        Column("step", step_of, 2, right=True),
        Column("calls", lambda e: count(e.row.get("calls")), 2, right=True),
    ]
    return columns


def live_columns(servers: int) -> list[Column]:
    """The live list's columns, most important first in `priority` (see layout.fit)."""
    return [
        *_common_columns(servers),
        Column("idle", lambda e: duration(e.row.get("idle_s")), 2, True, style=_idle_style),
        Column("fail", lambda e: count(e.row.get("failures")), 2, True, style=_failure_style),
        Column("age", lambda e: duration(e.row.get("age_s")), 4, right=True),
        Column("paths", lambda e: count(e.row.get("paths")), 5, right=True),
        Column("ms", lambda e: _ms((e.row.get("last_call") or {}).get("latency_ms")), 6, True),
        Column(
            "finish", lambda e: str((e.row.get("last_call") or {}).get("finish_reason") or "-"), 7
        ),
        Column("nodes", lambda e: count(e.row.get("nodes")), 8, right=True),
        Column("unbr", lambda e: count(e.row.get("unbridged_calls")), 8, right=True),
        Column("last error", _last_error, 9, flex=True, min_width=12, style=lambda e: "red"),
    ]


def recent_columns(servers: int, now: float) -> list[Column]:
    """The recently ended list's columns."""

    def ended(e: Entry) -> str:
        at = e.row.get("ended_at")
        return "-" if at is None else duration(now - at) + " ago"

    def took(e: Entry) -> str:
        at, start = e.row.get("ended_at"), e.row.get("created_at")
        return "-" if at is None or start is None else duration(at - start)

    return [
        *_common_columns(servers),
        Column("fail", lambda e: count(e.row.get("failures")), 2, True, style=_failure_style),
        Column("ended", ended, 2, right=True),
        Column("took", took, 4, right=True),
        Column("reward", _reward, 3, right=True),
        Column("record", _record, 6, flex=True, min_width=8),
        Column("last error", _last_error, 9, flex=True, min_width=12, style=lambda e: "red"),
    ]


def _ms(value: Any) -> str:
    return "-" if value is None else f"{float(value):,.0f}"


def server_columns() -> list[Column]:
    """The servers table: one row per server (and a total row for several)."""

    def get(name: str) -> Callable[[ServerState], str]:
        return lambda s: count(s.health.get(name)) if s.up else "-"

    def rate(name: str) -> Callable[[ServerState], str]:
        return lambda s: compact(getattr(s, name)) if s.up else "-"

    return [
        Column("server", lambda s: s.url, 1, flex=True, min_width=12),
        Column(
            "mode",
            lambda s: s.mode if s.up else "DOWN",
            1,
            style=lambda s: "green" if s.up else "bold red",
        ),
        Column("open", get("open_trajectories"), 1, right=True),
        Column("calls", get("calls_total"), 1, right=True),
        Column(
            "fail",
            get("failures_total"),
            1,
            right=True,
            style=lambda s: "bold red" if s.health.get("failures_total") else "",
        ),
        Column("ended", get("ended_total"), 2, right=True),
        Column(
            "tokens",
            lambda s: compact(s.health.get("tokens_total")) if counts_tokens(s) else "-",
            2,
            right=True,
        ),
        Column("calls/s", rate("calls_per_s"), 3, right=True),
        Column(
            "tok/s", lambda s: compact(s.tokens_per_s) if counts_tokens(s) else "-", 4, right=True
        ),
        Column("cache hits", _render_cache, 5, right=True),
    ]


def counts_tokens(server: ServerState) -> bool:
    """The token columns are token mode's (docs/tools.md): a text-mode server shows `-`,
    since the usage an upstream reports is its own count, not tokens skycap saw."""
    return server.up and server.mode != "text"


def _render_cache(server: ServerState) -> str:
    """Token mode's render cache: prompts served from it, and the bytes it holds."""
    hits, held = server.health.get("render_cache_hits"), server.health.get("render_cache_bytes")
    if not server.up or hits is None:
        return "-"
    return f"{compact(hits)} {compact(held)}B"


def total(servers: list[ServerState]) -> ServerState:
    """A pseudo-server summing the counters of the servers that are up."""
    up = [s for s in servers if s.up]
    names = ("open_trajectories", "calls_total", "failures_total", "ended_total", "tokens_total")
    summed = ServerState(f"all {len(up)} of {len(servers)} up", up=bool(up))
    summed.health = {n: sum(int(s.health.get(n) or 0) for s in up) for n in names}
    summed.health["tokens_total"] = sum(
        int(s.health.get("tokens_total") or 0) for s in up if counts_tokens(s)
    )
    for name in ("render_cache_hits", "render_cache_bytes"):
        held = [int(s.health[name]) for s in up if name in s.health]
        if held:
            summed.health[name] = sum(held)
    modes = {s.mode for s in up}
    summed.health["capture"] = {"mode": modes.pop() if len(modes) == 1 else "mixed"}
    summed.calls_per_s = sum(s.calls_per_s or 0.0 for s in up) if up else None
    summed.tokens_per_s = sum(s.tokens_per_s or 0.0 for s in up if counts_tokens(s)) if up else None
    return summed

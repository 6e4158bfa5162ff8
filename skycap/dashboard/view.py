"""The screens of `skycap top`: live and recently ended trajectories, one trajectory, help.

`View` holds what the person at the terminal chose (screen, sort, filter, selection) and
`render` draws one frame of exactly the terminal's size from it and the polled servers.
Keys arrive as names (`up`, `enter`, `esc`, a character) from the terminal loop in
`skycap.cli.top`, which owns the terminal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.text import Text

from skycap.dashboard.layout import (
    Column,
    clip,
    compact,
    count,
    duration,
    fit,
    header_line,
    row_line,
)
from skycap.dashboard.poll import ServerState

LIVE, RECENT, DETAIL, HELP = "live", "recent", "detail", "help"
#: Seconds without a call after which a live trajectory's idle time is shown in yellow.
IDLE_WARN_S = 60.0
#: The newest calls (and failures) the detail view lists.
DETAIL_CALLS = 50


@dataclass(frozen=True)
class Entry:
    """One row: a trajectory as its server listed it."""

    server: ServerState
    number: int  # the server's position on the command line, from 1
    row: dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.row.get("id", "?"))

    @property
    def meta(self) -> dict[str, Any]:
        meta = self.row.get("meta")
        return meta if isinstance(meta, dict) else {}


def task_of(entry: Entry) -> str:
    """The task a trajectory works on: `task`, else `task_id`, else `instance_id` in meta."""
    meta = entry.meta
    for key in ("task", "task_id", "instance_id"):
        if meta.get(key) is not None:
            return str(meta[key])
    return "-"


def _step(entry: Entry) -> str:
    step = entry.meta.get("step")
    return "-" if step is None else str(step)


def _latency(entry: Entry) -> float:
    return float((entry.row.get("last_call") or {}).get("latency_ms") or 0.0)


SORT_KEYS: dict[str, tuple[str, Callable[[Entry], Any]]] = {
    "a": ("age", lambda e: e.row.get("age_s") or 0.0),
    "i": ("idle", lambda e: e.row.get("idle_s") or 0.0),
    "c": ("calls", lambda e: e.row.get("calls") or 0),
    "n": ("nodes", lambda e: e.row.get("nodes") or 0),
    "p": ("paths", lambda e: e.row.get("paths") or 0),
    "u": ("unbridged", lambda e: e.row.get("unbridged_calls") or 0),
    "f": ("failures", lambda e: e.row.get("failures") or 0),
    "l": ("latency", _latency),
}
SORT_NAMES = {label: key for key, (label, _) in SORT_KEYS.items()}

# -- filters ---------------------------------------------------------------------------------


def matches(entry: Entry, query: str) -> bool:
    """Whether a row passes the filter: every word must match (case-insensitive).

    `task:WORD` matches meta `task`, `task_id` or `instance_id`; `step:N` the step exactly;
    `status:WORD` and `id:WORD` their field; a bare word any of them.
    """
    meta = entry.meta
    tasks = [str(meta[k]).lower() for k in ("task", "task_id", "instance_id") if k in meta]
    fields = {
        "task": tasks,
        "step": [_step(entry).lower()],
        "status": [str(entry.row.get("status", "")).lower()],
        "id": [entry.id.lower()],
    }
    for word in query.lower().split():
        name, colon, wanted = word.partition(":")
        if colon and name in fields:
            values = fields[name]
            if not any(wanted == v if name == "step" else wanted in v for v in values):
                return False
        elif not any(word in v for values in fields.values() for v in values):
            return False
    return True


# -- the view state --------------------------------------------------------------------------


@dataclass
class View:
    """What is on screen: the chosen screen, sort, filter and selected trajectory."""

    sort: str = "a"
    screen: str = LIVE
    query: str = ""
    editing: str | None = None  # the filter being typed, None when not typing
    selected: str | None = None  # id of the highlighted row
    cursor: int = 0  # its position, kept when the row goes away
    offset: int = 0  # first row shown
    page: int = 10  # rows per page, set by the last frame
    detail: Entry | None = None
    document: dict[str, Any] | str | None = None
    _back: str = LIVE
    _help_from: str = LIVE
    shown: list[Entry] = field(default_factory=list)
    _servers: list[ServerState] = field(default_factory=list)

    def key(self, key: str) -> bool:
        """Apply one key; returns False when the person asked to quit."""
        if self.editing is not None:
            self._edit(key)
            return True
        if key == "q":
            return False
        if self.screen == HELP:
            self.screen = self._help_from
        elif key == "?":
            self._help_from, self.screen = self.screen, HELP
        elif self.screen == DETAIL:
            if key in ("esc", "backspace", "left", "h"):
                self.screen, self.detail, self.document = self._back, None, None
        elif key in ("up", "k"):
            self._move(-1)
        elif key in ("down", "j"):
            self._move(1)
        elif key == "pgup":
            self._move(-self.page)
        elif key in ("pgdn", " "):
            self._move(self.page)
        elif key in ("home", "g"):
            self._move(-len(self.shown))
        elif key in ("end", "G"):
            self._move(len(self.shown))
        elif key in ("enter", "right"):
            self._open()
        elif key == "/":
            self.editing = self.query
        elif key == "esc":
            self.query = ""
        elif key == "r":
            self.screen = RECENT if self.screen == LIVE else LIVE
            self.selected, self.cursor, self.offset = None, 0, 0
        elif key in SORT_KEYS:
            self.sort = key
        return True

    def _edit(self, key: str) -> None:
        assert self.editing is not None
        if key == "enter":
            self.query, self.editing = self.editing.strip(), None
            self.selected, self.cursor, self.offset = None, 0, 0
        elif key == "esc":
            self.editing = None
        elif key == "backspace":
            self.editing = self.editing[:-1]
        elif len(key) == 1 and key.isprintable():
            self.editing += key

    def _move(self, delta: int) -> None:
        self.rows(self._servers)  # a key before it may have changed the filter
        if not self.shown:
            return
        self.cursor = max(0, min(len(self.shown) - 1, self.cursor + delta))
        self.selected = self.shown[self.cursor].id

    def _open(self) -> None:
        self.rows(self._servers)
        if self.shown:
            self.detail = self.shown[min(self.cursor, len(self.shown) - 1)]
            self._back, self.screen, self.document = self.screen, DETAIL, None

    def refresh_detail(self) -> None:
        """Replace the detail view's row with its server's newest one, live or ended."""
        if self.detail is None:
            return
        server = self.detail.server
        for row in (*server.trajectories, *server.recent):
            if row.get("id") == self.detail.id:
                self.detail = Entry(server, self.detail.number, row)
                return

    def rows(self, servers: list[ServerState]) -> list[Entry]:
        """The rows of the current list screen, filtered and sorted, and the cursor placed."""
        self._servers = servers
        recent = self.screen == RECENT or (self.screen != LIVE and self._back == RECENT)
        entries = [
            Entry(server, number, row)
            for number, server in enumerate(servers, start=1)
            if server.up
            for row in (server.recent if recent else server.trajectories)
        ]
        query = self.editing if self.editing is not None else self.query
        entries = [e for e in entries if matches(e, query)]
        if recent:
            entries.sort(key=lambda e: e.row.get("ended_at") or 0.0, reverse=True)
        else:
            entries.sort(key=lambda e: SORT_KEYS[self.sort][1](e), reverse=True)
        ids = [e.id for e in entries]
        if self.selected in ids:
            self.cursor = ids.index(self.selected)
        elif entries:
            self.cursor = min(self.cursor, len(entries) - 1)
            self.selected = ids[self.cursor]
        self.shown = entries
        return entries


# -- columns ---------------------------------------------------------------------------------


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
        Column("step", _step, 2, right=True),
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
            lambda s: compact(s.health.get("tokens_total")) if s.up else "-",
            2,
            right=True,
        ),
        Column("calls/s", rate("calls_per_s"), 3, right=True),
        Column("tok/s", rate("tokens_per_s"), 4, right=True),
    ]


def total(servers: list[ServerState]) -> ServerState:
    """A pseudo-server summing the counters of the servers that are up."""
    up = [s for s in servers if s.up]
    names = ("open_trajectories", "calls_total", "failures_total", "ended_total", "tokens_total")
    summed = ServerState(f"all {len(up)} of {len(servers)} up", up=bool(up))
    summed.health = {n: sum(int(s.health.get(n) or 0) for s in up) for n in names}
    modes = {s.mode for s in up}
    summed.health["capture"] = {"mode": modes.pop() if len(modes) == 1 else "mixed"}
    summed.calls_per_s = sum(s.calls_per_s or 0.0 for s in up) if up else None
    summed.tokens_per_s = sum(s.tokens_per_s or 0.0 for s in up) if up else None
    return summed


# -- frames ----------------------------------------------------------------------------------


def render(
    servers: list[ServerState], view: View, width: int, height: int | None, *, keys: bool = True
) -> Group:
    """One frame; `height` None draws every row (`--once`), else exactly `height` lines."""
    now = time.time()
    if view.screen == HELP:
        lines = help_lines(width)
    elif view.screen == DETAIL:
        view.refresh_detail()
        lines = detail_lines(view, width, now)
    else:
        lines = list_lines(servers, view, width, height, now)
    if height is not None:
        lines = lines[: height - 1] if keys else lines[:height]
        lines += [Text("")] * ((height - 1 if keys else height) - len(lines))
    if keys:
        lines.append(footer(view, width))
    return Group(*lines)


def servers_lines(servers: list[ServerState], width: int, now: float) -> list[Text]:
    rows = servers + ([total(servers)] if len(servers) > 1 else [])
    layout = fit(server_columns(), rows, width)
    lines = [header_line(layout), *(row_line(layout, s) for s in rows)]
    for server in servers:
        if not server.up:
            lines.append(Text(clip(f"{server.url} down: {server.error}", width), style="red"))
    newest = _newest_failure(servers)
    if newest is not None:
        at, trajectory_id, message = newest
        text = f"last error {duration(now - at)} ago, {trajectory_id}: {message}"
        lines.append(Text(clip(text, width), style="red"))
    return lines


def _newest_failure(servers: list[ServerState]) -> tuple[float, str, str] | None:
    found = None
    for server in servers:
        if not server.up:
            continue
        for row in (*server.trajectories, *server.recent):
            failure = row.get("last_failure")
            if isinstance(failure, dict) and (found is None or failure.get("at", 0) > found[0]):
                found = (float(failure.get("at") or 0), str(row.get("id")), str(failure["message"]))
    return found


def list_lines(
    servers: list[ServerState], view: View, width: int, height: int | None, now: float
) -> list[Text]:
    lines = servers_lines(servers, width, now)
    lines.append(Text(""))
    entries = view.rows(servers)
    recent = view.screen == RECENT
    columns = recent_columns(len(servers), now) if recent else live_columns(len(servers))
    layout = fit(columns, entries, width)
    every = sum(len(s.recent if recent else s.trajectories) for s in servers if s.up)
    title = "recently ended" if recent else "live trajectories"
    title += f" ({len(entries)} of {every}, filter: {view.query})" if view.query else f" ({every})"
    if not recent:
        title += f", by {SORT_KEYS[view.sort][0]}"
    room = None if height is None else max(1, height - len(lines) - 3)
    if room is not None:
        view.page = room
        if view.cursor < view.offset:
            view.offset = view.cursor
        elif view.cursor >= view.offset + room:
            view.offset = view.cursor - room + 1
        view.offset = max(0, min(view.offset, max(0, len(entries) - room)))
        shown = entries[view.offset : view.offset + room]
        if len(entries) > room:
            title += f"   rows {view.offset + 1}-{view.offset + len(shown)} of {len(entries)}"
    else:
        shown = entries
    lines.append(Text(clip(title, width), style="bold"))
    lines.append(header_line(layout))
    first = view.offset if room is not None else 0
    for i, entry in enumerate(shown, start=first):
        lines.append(row_line(layout, entry, selected=room is not None and i == view.cursor))
    if not entries:
        lines.append(Text("  (none" + (" match the filter)" if view.query else ")"), style="dim"))
    return lines


def footer(view: View, width: int) -> Text:
    if view.editing is not None:
        return Text(clip(f"filter: {view.editing}▏  enter apply  esc cancel", width), "bold")
    if view.screen == DETAIL:
        hint = "esc back  ?=help  q=quit"
    elif view.screen == HELP:
        hint = "any key: back"
    else:
        other = "live" if view.screen == RECENT else "recent"
        hint = f"↑↓ move  enter detail  /=filter  r={other}  ?=help  q=quit"
    return Text(clip(hint, width), style="dim")


def help_lines(width: int) -> list[Text]:
    sorts = "  ".join(f"{k}={label}" for k, (label, _) in SORT_KEYS.items())
    text = [
        ("skycap top: keys", "bold"),
        ("↑/↓ or j/k  move    PgUp/PgDn  page    g/G  first/last", ""),
        ("enter  one trajectory: its recent calls and what each got back", ""),
        ("esc    back (in a list: clear the filter)", ""),
        ("/      filter: words all match; task:W step:N status:W id:W", ""),
        ("       task: matches meta task, task_id or instance_id", ""),
        ("r      live trajectories <-> recently ended (the last 256)", ""),
        (f"sort   {sorts}", ""),
        ("q      quit", ""),
        ("", ""),
        ("columns", "bold"),
        ("idle   time since the trajectory's last call (yellow after 60 s;", ""),
        ("       the server abandons it after its --ttl); 0 while a call runs", ""),
        ("fail   calls that produced no node: engine or upstream errors", ""),
        ("paths  root-to-leaf paths (samples); more than 1 means a fork", ""),
        ("unbr   token mode: calls rendered in full instead of bridged", ""),
        ("ms     latency of the last call; finish its finish reason", ""),
        ("ended  servers: trajectories finished or abandoned since start", ""),
    ]
    return [Text(clip(line, width), style=style) for line, style in text]


def detail_lines(view: View, width: int, now: float) -> list[Text]:
    entry = view.detail
    assert entry is not None
    row = entry.row
    lines = [
        Text(clip(f"trajectory {entry.id} on {entry.server.url}", width), style="bold"),
    ]
    status = str(row.get("status", "?"))
    facts = [
        f"status {status}",
        f"age {duration(row.get('age_s'))}",
        f"idle {duration(row.get('idle_s'))}" if "idle_s" in row else None,
        f"calls {count(row.get('calls'))}",
        f"nodes {count(row.get('nodes'))}",
        f"paths {count(row.get('paths'))}",
        f"unbridged {count(row.get('unbridged_calls'))}",
        f"failures {count(row.get('failures'))}",
    ]
    lines += wrapped([f for f in facts if f], width)
    lines += wrapped(["meta", *(f"{k}={v}" for k, v in entry.meta.items())], width)
    document = view.document
    if isinstance(document, dict) and document.get("annotations"):
        annotations = document["annotations"].items()
        lines += wrapped(["annotations", *(f"{k}={v}" for k, v in annotations)], width)
    if status == "open" and not row.get("ended_at"):
        hint = f"open: end it with POST /trajectories/{entry.id}/finish"
        lines.append(Text(clip(hint, width), style="dim"))
    lines.append(Text(""))
    if document is None:
        lines.append(Text("reading the trajectory...", style="dim"))
        return lines
    if isinstance(document, str):
        lines.append(Text(clip(f"cannot read the trajectory: {document}", width), style="red"))
        return lines
    lines.append(Text("recent calls, newest first", style="bold"))
    events = call_events(document)[:DETAIL_CALLS]
    columns = [
        Column("when", lambda e: duration(now - e["t"]) + " ago", 1, right=True),
        Column("ms", lambda e: e["ms"], 1, right=True),
        Column("in", lambda e: e["prompt"], 2, right=True),
        Column("out", lambda e: e["completion"], 2, right=True),
        Column(
            "finish", lambda e: e["finish"], 1, style=lambda e: "bold red" if e["error"] else ""
        ),
        Column(
            "got back",
            lambda e: e["reply"],
            1,
            flex=True,
            min_width=16,
            style=lambda e: "red" if e["error"] else "",
        ),
    ]
    layout = fit(columns, events, width)
    lines.append(header_line(layout))
    lines.extend(row_line(layout, event) for event in events)
    if not events:
        lines.append(Text("  (no call yet)", style="dim"))
    return lines


def wrapped(parts: list[str], width: int) -> list[Text]:
    """Parts joined by two spaces, broken into lines of `width` (a part longer is cut)."""
    lines: list[str] = []
    for part in parts:
        part = clip(part, width)
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "  " + part
        else:
            lines.append(part)
    return [Text(line) for line in lines]


def call_events(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The document's calls and failures as one list, newest first, with what each got back."""
    events = []
    for node in document.get("nodes") or ():
        for call in node.get("calls") or ():
            usage = call.get("usage") or {}
            t_start, t_end = call.get("t_start") or 0.0, call.get("t_end") or 0.0
            events.append(
                {
                    "t": t_end,
                    "ms": f"{(t_end - t_start) * 1000:,.0f}",
                    "prompt": count(usage.get("prompt_tokens")),
                    "completion": count(usage.get("completion_tokens")),
                    "finish": str(call.get("finish_reason") or "-"),
                    "reply": reply_text(node.get("message") or {}),
                    "error": False,
                }
            )
    for failure in document.get("failures") or ():
        status = failure.get("status")
        events.append(
            {
                "t": failure.get("t") or 0.0,
                "ms": "-",
                "prompt": "-",
                "completion": "-",
                "finish": "error" if status is None else f"error {status}",
                "reply": str(failure.get("error", "")),
                "error": True,
            }
        )
    events.sort(key=lambda e: e["t"], reverse=True)
    return events


def reply_text(message: dict[str, Any]) -> str:
    """A one-line excerpt of a model reply: its text, then its tool calls."""
    parts = []
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    if content:
        parts.append(" ".join(str(content).split()))
    elif message.get("reasoning_content"):
        parts.append("(thinking) " + " ".join(str(message["reasoning_content"]).split()))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        parts.append(f"{function.get('name', '?')}({function.get('arguments', '')})")
    return " | ".join(parts) or "(empty)"

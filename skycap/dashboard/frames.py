"""One frame of `skycap top`, of exactly the terminal's size: the servers, a list, help, keys.

`render` draws the screen the `View` is on from the polled servers; the terminal loop in
`skycap.cli.top` owns the terminal and calls it for every frame.
"""

from __future__ import annotations

import time

from rich.console import Group
from rich.text import Text

from skycap.dashboard.columns import live_columns, recent_columns, server_columns, total
from skycap.dashboard.detail import detail_lines
from skycap.dashboard.entries import SORT_KEYS
from skycap.dashboard.layout import clip, duration, fit, header_line, row_line
from skycap.dashboard.poll import ServerState
from skycap.dashboard.view import DETAIL, HELP, RECENT, View


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
        title += f", by {SORT_KEYS[view.sort][0]}" + (", reversed" if view.reversed else "")
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


def sort_lines(width: int) -> list[str]:
    """The sort keys, as many to a line as fit `width`, so none is cut at 80 columns."""
    lines, line = [], "sort  "
    for key, (label, _) in SORT_KEYS.items():
        item = f" {key}={label}"
        if len(line) + len(item) > width and line.strip() != "sort":
            lines.append(line)
            line = "      "
        line += item
    lines.append(line)
    lines.append("       (the same key again: reverse the order)")
    return lines


def help_lines(width: int) -> list[Text]:
    text = [
        ("skycap top: keys", "bold"),
        ("↑/↓ or j/k  move    PgUp/PgDn  page    g/G  first/last", ""),
        ("enter  one trajectory: its recent calls and what each got back", ""),
        ("esc    back (in a list: clear the filter)", ""),
        ("/      filter: words all match; task:W step:N status:W id:W", ""),
        ("       task: matches meta task, task_id or instance_id", ""),
        ("r      live trajectories <-> recently ended (the last 256)", ""),
        *((line, "") for line in sort_lines(width)),
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

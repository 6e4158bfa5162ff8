"""What the person at `skycap top`'s terminal chose: the screen, sort, filter and selection.

`View` applies each key as a name (`up`, `enter`, `esc`, a character) from the terminal
loop in `skycap.cli.top`, and places the cursor in the rows of the current list screen;
`frames.render` draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skycap.dashboard.entries import SORT_KEYS, Entry, matches
from skycap.dashboard.poll import ServerState

LIVE, RECENT, DETAIL, HELP = "live", "recent", "detail", "help"


@dataclass
class View:
    """What is on screen: the chosen screen, sort, filter and selected trajectory."""

    sort: str = "a"
    reversed: bool = False  # smallest first; the sort key pressed again flips it
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
            self.reversed = not self.reversed if key == self.sort else False
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
            entries.sort(key=lambda e: SORT_KEYS[self.sort][1](e), reverse=not self.reversed)
        ids = [e.id for e in entries]
        if self.selected in ids:
            self.cursor = ids.index(self.selected)
        elif entries:
            self.cursor = min(self.cursor, len(entries) - 1)
            self.selected = ids[self.cursor]
        self.shown = entries
        return entries

"""Fixed-width tables for a terminal: numbers are never cut, columns drop out by priority.

Rich's tables shrink every column when space runs out, which turns numbers into `…` at
80 columns. Here a column is either fixed (numbers, ids, times: always as wide as its
widest cell) or flexible (free text: takes what is left, cut with `…`), and when even the
fixed columns do not fit, the least important columns are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text

GAP = 2


@dataclass(frozen=True)
class Column:
    """One column: header, how to draw a row's cell, and how it yields to the width.

    `priority`: lower numbers stay longest. `flex`: free text that may be cut (its
    `min_width` is kept); otherwise the column is as wide as its widest cell.
    """

    header: str
    cell: Callable[[Any], str]
    priority: int
    right: bool = False
    flex: bool = False
    min_width: int = 4
    style: Callable[[Any], str] | None = None


def fit(columns: Sequence[Column], rows: Sequence[Any], width: int) -> list[tuple[Column, int]]:
    """The columns that fit in `width`, in their given order, with each one's width."""
    cells = {id(c): [c.cell(row) for row in rows] for c in columns}
    natural = {id(c): max([len(c.header), *(len(v) for v in cells[id(c)])]) for c in columns}
    need = {id(c): min(natural[id(c)], c.min_width) if c.flex else natural[id(c)] for c in columns}
    kept = list(columns)
    while kept and sum(need[id(c)] for c in kept) + GAP * (len(kept) - 1) > width:
        kept.remove(max(kept, key=lambda c: c.priority))
    spare = width - sum(need[id(c)] for c in kept) - GAP * (len(kept) - 1)
    widths = {id(c): need[id(c)] for c in kept}
    flexible = [c for c in kept if c.flex]
    # Give the flexible columns what is left, up to their natural width, fairly.
    while spare > 0 and flexible:
        wanting = [c for c in flexible if widths[id(c)] < natural[id(c)]]
        if not wanting:
            break
        share = max(1, spare // len(wanting))
        for c in wanting:
            grow = min(share, natural[id(c)] - widths[id(c)], spare)
            widths[id(c)] += grow
            spare -= grow
    return [(c, widths[id(c)]) for c in kept]


def clip(text: str, width: int) -> str:
    """`text` in at most `width` characters, cut with `…` when longer."""
    text = text.replace("\n", " ")
    if len(text) <= width:
        return text
    return text[: max(0, width - 1)] + "…" if width > 0 else ""


def _pad(text: str, width: int, right: bool) -> str:
    text = clip(text, width)
    return text.rjust(width) if right else text.ljust(width)


def header_line(layout: Sequence[tuple[Column, int]]) -> Text:
    line = Text(style="bold")
    for i, (column, width) in enumerate(layout):
        if i:
            line.append(" " * GAP)
        line.append(_pad(column.header, width, column.right))
    return line


def row_line(layout: Sequence[tuple[Column, int]], row: Any, *, selected: bool = False) -> Text:
    line = Text(style="reverse" if selected else "")
    for i, (column, width) in enumerate(layout):
        if i:
            line.append(" " * GAP)
        style = column.style(row) if column.style is not None else ""
        line.append(_pad(column.cell(row), width, column.right), style=style or None)
    return line


# -- how numbers and times are written -------------------------------------------------------


def count(value: Any) -> str:
    """An integer with thousands separators; `-` when missing."""
    return "-" if value is None else f"{int(value):,}"


def compact(value: float | None) -> str:
    """A large figure in 5 characters or fewer: 987, 12.3k, 4.56M."""
    if value is None:
        return "-"
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            scaled = value / limit
            digits = 2 if scaled < 10 else 1 if scaled < 100 else 0
            return f"{scaled:.{digits}f}{suffix}"
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def duration(seconds: float | None) -> str:
    """Elapsed time in at most 6 characters: 42s, 3m05s, 2h07m, 3d04h."""
    if seconds is None:
        return "-"
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"{int(seconds // 86400)}d{int(seconds % 86400 // 3600):02d}h"

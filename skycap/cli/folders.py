"""What the record-reading commands share: finding record directories, and a progress line.

`skycap summary` and `skycap validate` accept a record directory or a folder of them (a
run per subfolder, as `skycap view` reads them), and say so when there is nothing to
read instead of printing zeros. Long work shows a counter on a terminal's stderr.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

#: Seconds of silent work before the progress line appears, and between its updates.
PROGRESS_DELAY = 1.0
PROGRESS_EVERY = 0.1


def record_folders(given: list[tuple[str, Path]]) -> list[Path] | str:
    """The record directories under each (name as given, local path): the path itself, or
    its subfolders that hold records, in order and without repeats; or a message naming
    the argument that holds none."""
    from skycap.viewer.index import record_directories

    found: list[Path] = []
    for name, path in given:
        folders = record_directories(path)
        if not folders:
            return (
                f"no records in {name}: no *.json.zst document in it or in its subfolders "
                "(two levels down)"
            )
        found += [folder for folder in folders if folder not in found]
    return found


class Progress:
    """`label: done/total what` on stderr, redrawn in place; only on a terminal, only once
    the work has taken `PROGRESS_DELAY` seconds, and erased when the work ends."""

    def __init__(
        self,
        label: str,
        total: int,
        what: str = "records",
        *,
        stream: TextIO | None = None,
        delay: float = PROGRESS_DELAY,
    ) -> None:
        self.label, self.total, self.what = label, total, what
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty()
        self.done = 0
        self._start = time.monotonic()
        self._next = self._start + delay
        self._drawn = False

    def step(self, count: int = 1) -> None:
        self.done += count
        if not self.enabled:
            return
        now = time.monotonic()
        if now >= self._next:
            self._next = now + PROGRESS_EVERY
            self.stream.write(f"\r{self.label}: {self.done:,}/{self.total:,} {self.what}")
            self.stream.flush()
            self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

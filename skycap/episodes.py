"""Failure episodes: one cause failing for many trajectories is a few log lines, not one each.

A full disk, a record mirror that is down or an upstream refusing connections fails every
trajectory at once; a line per trajectory per retry floods the log (and, before the log
queue, stalled the loop on a full stderr pipe). An episode logs one line when the cause
starts failing, one summary at most every `every` seconds while it lasts (how many
trajectories, failures and retries, the first few ids named and the rest counted), and one
line when it ends; its counters go to `/healthz` (docs/http.md §13).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

#: The most often a failing cause is summarised, in seconds.
SUMMARY_EVERY = 10.0
#: How many trajectory ids a line names before it counts the rest.
NAMED = 5


class FailureEpisode:
    """One cause of failure (`cause` reads as a sentence's subject and verb, e.g. "records
    cannot be written to /data"). Thread-safe: mirror copies fail on worker threads.

    `failed(subject, detail)` notes a failure of one trajectory; a subject already hit in
    this episode counts as a retry. `succeeded(subject)` notes that this subject works
    again and `succeeded()` that the cause works for all: the episode ends once no subject
    is still failing.
    """

    def __init__(
        self,
        logger: logging.Logger,
        cause: str,
        *,
        every: float = SUMMARY_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.cause = cause
        self.every = every
        self.clock = clock
        self._lock = threading.Lock()
        self._failing: set[str] = set()  # subjects failing now
        self._hit: dict[str, None] = {}  # every subject of this episode, in order
        self._failures = 0
        self._retries = 0
        self._since = 0.0
        self._last_line = 0.0
        self._detail = ""
        self.episodes_total = 0
        self.failures_total = 0

    @property
    def active(self) -> bool:
        return bool(self._hit)

    def failed(self, subject: str, detail: str) -> None:
        """One failure of `subject`; logs only when the episode starts or a summary is due."""
        now = self.clock()
        with self._lock:
            self.failures_total += 1
            self._failures += 1
            self._detail = detail
            self._failing.add(subject)
            if not self._hit:
                self.episodes_total += 1
                self._since = self._last_line = now
                self._hit[subject] = None
                line: tuple[Any, ...] | None = (
                    logging.ERROR,
                    "%s: %s (first: %s); summarised at most every %g s until it recovers",
                    self.cause,
                    detail,
                    subject,
                    self.every,
                )
            else:
                if subject in self._hit:
                    self._retries += 1
                else:
                    self._hit[subject] = None
                line = None
                if now - self._last_line >= self.every:
                    self._last_line = now
                    line = (
                        logging.WARNING,
                        "%s, still failing after %.0f s: %s; last: %s",
                        self.cause,
                        now - self._since,
                        self._tally(),
                        detail,
                    )
        if line is not None:
            self.logger.log(line[0], *line[1:])

    def succeeded(self, subject: str | None = None) -> None:
        """`subject` (or, with None, every subject) works again; the last one ends it."""
        if not self._hit:  # the common case, without the lock: nothing is failing
            return
        with self._lock:
            if subject is None:
                self._failing.clear()
            else:
                self._failing.discard(subject)
            if self._failing or not self._hit:
                return
            lasted = self.clock() - self._since
            tally = self._tally()
            self._hit = {}
            self._failures = self._retries = 0
        self.logger.warning("%s: recovered after %.1f s; %s", self.cause, lasted, tally)

    def _tally(self) -> str:
        hit = list(self._hit)
        named = ", ".join(hit[:NAMED])
        if len(hit) > NAMED:
            named += f" and {len(hit) - NAMED} more"
        return (
            f"{len(hit)} trajector{'y' if len(hit) == 1 else 'ies'} ({named}), "
            f"{self._failures} failures of which {self._retries} retries"
        )

    def health(self) -> dict[str, Any]:
        """The `/healthz` counters of this cause (docs/http.md §13)."""
        with self._lock:
            return {
                "failing": bool(self._hit),
                "since_s": round(self.clock() - self._since, 3) if self._hit else None,
                "trajectories": len(self._hit),
                "failing_now": len(self._failing),
                "episodes_total": self.episodes_total,
                "failures_total": self.failures_total,
                "last_error": self._detail if self._hit else None,
            }

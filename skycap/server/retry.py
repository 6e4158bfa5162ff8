"""The per-trajectory SDK retry cache of http.md §5 (in memory, never persisted).

Every chat call registers an entry under its key and settles it with a replayable reply or
with nothing; only the lookup is conditional (a retry count > 0 or an Idempotency-Key).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from skycap.hashing import bytes_digest

CAPACITY = 64
SETTLED_TTL = 600.0
REUSED_KEY = "Idempotency-Key was reused with a different request"
# http.md §5: a replayed copy drops the headers that describe the original transfer.
_NOT_REPLAYED = frozenset({b"content-length", b"date", b"server", b"transfer-encoding"})


@dataclass(frozen=True, slots=True)
class Replay:
    """A complete, committed reply that a retry receives as a copy."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    @classmethod
    def of(cls, status: int, fields: Iterable[tuple[bytes, bytes]], body: bytes) -> Replay:
        """From raw header fields, as mitmproxy holds them (duplicates and order kept)."""
        kept = tuple((k, v) for k, v in fields if k.lower() not in _NOT_REPLAYED)
        return cls(status, kept, body)


@dataclass(frozen=True, slots=True)
class CallKey:
    """How one chat request is known to the cache."""

    key: str
    digest: str
    dedup: bool


def call_key(raw: bytes, retry_count: str | None, idempotency_key: str | None) -> CallKey:
    """Key, body digest, and whether the request looks for an earlier outcome (http.md §5)."""
    digest = bytes_digest(raw)
    key = f"key:{idempotency_key}" if idempotency_key is not None else f"body:{digest}"
    return CallKey(key, digest, idempotency_key is not None or _is_retry(retry_count))


def _is_retry(count: str | None) -> bool:
    if not count:
        return False
    try:
        return int(count.strip()) > 0
    except ValueError:
        return False


class Entry:
    """One call's outcome: a future resolved with a Replay, or None when nothing replayable."""

    __slots__ = ("digest", "outcome", "settled_at")

    def __init__(self, digest: str) -> None:
        self.digest = digest
        self.outcome: asyncio.Future[Replay | None] = asyncio.get_running_loop().create_future()
        self.settled_at: float | None = None

    def settle(self, replay: Replay | None) -> None:
        """Record the outcome once; later calls (an error after a commit) change nothing."""
        if not self.outcome.done():
            self.outcome.set_result(replay)
            self.settled_at = time.monotonic()


class Conflict(Exception):
    """The key is known with a different body: answer 400 with REUSED_KEY."""


@dataclass(frozen=True, slots=True)
class Found:
    """What a deduplicated request gets instead of running: a copy, and whether it waited."""

    replay: Replay
    coalesced: bool


class RetryCache:
    """At most CAPACITY entries; settled ones expire after SETTLED_TTL; running ones stay."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def lookup(self, call: CallKey) -> Found | None:
        """Wait for an earlier call with this key; None means this request must run.

        Raises Conflict when the key was used with another body. A failed original is
        replaced by the first retry that sees it; later retries wait on that replacement,
        so several retries of one failed call share one new call.
        """
        while True:
            entry = self._current(call.key)
            if entry is None:
                return None
            if entry.digest != call.digest:
                raise Conflict(REUSED_KEY)
            waited = not entry.outcome.done()
            replay = await asyncio.shield(entry.outcome)
            if replay is not None:
                return Found(replay, waited)
            if self._entries.get(call.key) is entry:
                return None

    def running(self, call: CallKey) -> bool:
        """Whether an earlier call with this key and body is still running (`lookup` waits)."""
        entry = self._current(call.key)
        return entry is not None and entry.digest == call.digest and not entry.outcome.done()

    def register(self, call: CallKey) -> Entry:
        """A fresh entry for a call about to run, replacing any older one under its key."""
        self._expire()
        entry = Entry(call.digest)
        self._entries.pop(call.key, None)
        self._entries[call.key] = entry
        self._evict()
        return entry

    def _current(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None and _expired(entry, time.monotonic()):
            del self._entries[key]
            return None
        return entry

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, e in self._entries.items() if _expired(e, now)]:
            del self._entries[key]

    def _evict(self) -> None:
        """Drop the oldest settled entries beyond CAPACITY; running entries are never evicted."""
        excess = len(self._entries) - CAPACITY
        if excess <= 0:
            return
        for key in [k for k, e in self._entries.items() if e.settled_at is not None][:excess]:
            del self._entries[key]


def _expired(entry: Entry, now: float) -> bool:
    return entry.settled_at is not None and now - entry.settled_at > SETTLED_TTL

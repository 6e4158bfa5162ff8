"""A trajectory in memory with what only the server needs, and its `GET /trajectories` row."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from skycap.hashing import Remembered
from skycap.server.retry import RetryCache
from skycap.trajectory import Trajectory


class Live:
    """A trajectory in memory with what only the server needs: key, lock, calls in flight."""

    __slots__ = (
        "trajectory",
        "api_key",
        "lock",
        "retries",
        "inflight",
        "last_activity",
        "last_call",
        "calls",
        "unwritten",
        "counted_failures",
        "closed",
        "hashes",
        "__weakref__",
    )

    def __init__(self, trajectory: Trajectory, api_key: str, lock: asyncio.Lock) -> None:
        self.trajectory = trajectory
        self.api_key = api_key.encode("ascii")
        self.lock = lock
        self.retries = RetryCache()
        # call token -> how to cancel it (drop its connection or cancel its task), http.md §6
        self.inflight: dict[object, Callable[[], None]] = {}
        self.last_activity = time.time()
        self.last_call: dict[str, Any] | None = None
        self.calls = sum(len(node.calls) for node in trajectory.graph)
        self.unwritten = False
        # Failures already in `failures_total`: one read back from disk counts none again.
        self.counted_failures = len(trajectory.failures)
        # Why it takes no more calls while its status stays as it is, else None.
        self.closed: str | None = None
        # Its messages' and tools' hashes: a call hashes only what its last call did not send.
        self.hashes = Remembered()

    @property
    def id(self) -> str:
        return self.trajectory.id

    def touch(self) -> None:
        self.last_activity = time.time()

    def cancel_inflight(self, keep: object = None) -> None:
        """Cancel every call in flight except `keep` (sealing, http.md §6)."""
        for token, cancel in list(self.inflight.items()):
            if token is not keep:
                self.inflight.pop(token, None)
                cancel()

    def row(self, now: float) -> dict[str, Any]:
        """Its `GET /trajectories` row."""
        trajectory = self.trajectory
        graph = trajectory.graph
        failures = trajectory.failures
        last = failures[-1] if failures else None
        return {
            "id": trajectory.id,
            "status": trajectory.status,
            "meta": trajectory.meta,
            "created_at": trajectory.created_at,
            "age_s": round(now - trajectory.created_at, 3),
            "calls": self.calls,
            "nodes": len(graph),
            "paths": sum(1 for node in graph if not node.children),
            "unbridged_calls": trajectory.unbridged_calls(),
            "failures": len(failures),
            "last_failure": None if last is None else {"at": last["t"], "message": last["error"]},
            "last_activity": self.last_activity,
            # A call in flight waits on the model, not on the harness: not idle (nor swept).
            "idle_s": 0.0 if self.inflight else round(max(0.0, now - self.last_activity), 3),
            "last_call": self.last_call,
        }

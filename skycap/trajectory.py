"""A trajectory: its graph, status, meta, annotations, failures and retries (format.md §4, §7).

This is plain state with the lifecycle rules; the server decides when to call them and
the record writer serialises what `document()` returns.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from skycap.graph import Graph
from skycap.hashing import tools_hash

OPEN = "open"
FINISHED = "finished"
FAILED = "failed"
ABANDONED = "abandoned"
STATUSES = (OPEN, FINISHED, FAILED, ABANDONED)

ID_PATTERN = re.compile(r"tr_[0-9a-f]{16}")
FAILURE_ERROR_LIMIT = 2000


def new_trajectory_id() -> str:
    return "tr_" + secrets.token_hex(8)


def is_trajectory_id(value: str) -> bool:
    """Whether `value` is a well-formed id; anything else never reaches the record dir."""
    return ID_PATTERN.fullmatch(value) is not None


class AnnotationConflict(ValueError):
    """A finish on an ended trajectory that would add or change an annotation."""


class Trajectory:
    """One rollout's graph and bookkeeping. Mutate it only from one thread (the event loop)."""

    def __init__(
        self,
        id: str,
        *,
        capture: dict[str, Any],
        meta: dict[str, Any] | None = None,
        created_at: float | None = None,
        graph: Graph | None = None,
        provenance: dict[str, Any] | None = None,
    ) -> None:
        self.id = id
        self.capture = capture
        #: What produced the record beyond the weights (format.md §4, "provenance").
        self.provenance = provenance
        self.meta = meta or {}
        self.created_at = time.time() if created_at is None else created_at
        self.graph = graph or Graph()
        self.status = OPEN
        self.ended = False
        self.annotations: dict[str, Any] = {}
        self.finished_at: float | None = None
        self.tools: dict[str, list[Any]] = {}
        self.failures: list[dict[str, Any]] = []
        self.retries = {"replayed": 0, "coalesced": 0}
        self.samples: dict[str, Any] | None = None
        # Whether token mode refused a call with `context_length_exceeded`: reported by
        # finish (http.md §2.3), kept in memory only as the record format has no field for
        # it, so a trajectory read back from disk reports False.
        self.context_length_exceeded = False

    @property
    def mode(self) -> str:
        return self.capture.get("mode", "text")

    @property
    def is_open(self) -> bool:
        return self.status == OPEN

    def register_tools(self, tools: Any, key: str | None = None) -> str | None:
        """Store a non-empty tool list once under its hash; return the call's `tools` key.
        `key` is the list's `tools_hash` when the caller has it already."""
        if key is None:
            key = tools_hash(tools)
        if not key:
            return None
        self.tools.setdefault(key, tools)
        return key

    def add_failure(self, status: int | None, error: str) -> None:
        """Record a call that produced no node; ignored once the trajectory is sealed."""
        if not self.is_open:
            return
        self.failures.append(
            {
                "t": time.time(),
                "status": status,
                "error": error[:FAILURE_ERROR_LIMIT],
                "input_leaf": None,
            }
        )

    def seal(self, status: str) -> None:
        """Leave `open` (finish, TTL or a failed commit); a sealed trajectory keeps its status."""
        if self.is_open:
            self.status = status
            self.finished_at = time.time()

    def merge_annotations(self, annotations: dict[str, Any]) -> None:
        """Merge a finish's annotations. Once ended, new keys may be added (a reward for a
        rollout the TTL abandoned) but an existing value never changes."""
        if self.ended:
            for key, value in annotations.items():
                if key in self.annotations and self.annotations[key] != value:
                    raise AnnotationConflict(
                        f"trajectory has ended; annotation {key!r} is already "
                        f"{self.annotations[key]!r} and cannot change to {value!r}"
                    )
        self.annotations.update(annotations)

    def unbridged_calls(self) -> int:
        return sum(1 for call in self.graph.calls() if call.get("bridged") is False)

    def document(self, *, live: bool = False) -> dict[str, Any]:
        """The document fields of format.md §4, without `format_version` and `sidecars`.

        With `live`, nodes carry no `tokens` key, as `GET /trajectories/{id}` serves an
        in-memory trajectory (http.md §2.2); the record writer adds each node's `tokens`.
        """
        nodes = []
        for node in self.graph:
            entry = self.graph.node_json(node)
            if not live:
                entry["tokens"] = None
            nodes.append(entry)
        return {
            "id": self.id,
            "status": self.status,
            "ended": self.ended,
            "meta": self.meta,
            "capture": self.capture,
            "annotations": self.annotations,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "tools": self.tools,
            "failures": self.failures,
            "retries": self.retries,
            "samples": self.samples,
            **({} if self.provenance is None else {"provenance": self.provenance}),
            "nodes": nodes,
        }

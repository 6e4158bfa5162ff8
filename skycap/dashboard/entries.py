"""A trajectory row as `skycap top` lists it: its task and step, the sort keys and the filter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from skycap.dashboard.poll import ServerState


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


def step_of(entry: Entry) -> str:
    """The step a trajectory belongs to (meta `step`), or `-`."""
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


def matches(entry: Entry, query: str) -> bool:
    """Whether a row passes the filter: every word must match (case-insensitive).

    `task:WORD` matches meta `task`, `task_id` or `instance_id`; `step:N` the step exactly;
    `status:WORD` and `id:WORD` their field; a bare word any of them.
    """
    meta = entry.meta
    tasks = [str(meta[k]).lower() for k in ("task", "task_id", "instance_id") if k in meta]
    fields = {
        "task": tasks,
        "step": [step_of(entry).lower()],
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

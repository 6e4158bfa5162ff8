"""RecordLog: every attempt the rollout loop opened, per phase and step, for indexes and audits.

The loop writes it; readers (a step index such as `step.json`, docs/run-index.md "step.json"; a W&B
index; a trainer's own bookkeeping) read it after `generate` returns. An attempt is listed from the
moment it is opened, so a batch cut short still shows what it started; entries stay until
`discard` removes them (a long run should discard each step once it is indexed).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from skycap.client import RecordLocation

__all__ = ["AttemptRecord", "RecordLog"]


@dataclass
class AttemptRecord:
    """One attempt of one (instance, repetition): a trajectory the loop created, or tried to.

    `id` is None only when no server accepted the create (then nothing was recorded).
    `status`, `annotations` and `record` are None until a finish was answered (`annotations`
    is what was sent). `superseded` is True once a later attempt of the same instance and
    repetition was started in its place: such an attempt is never trained. `error` says why
    the attempt did not count (None for the one that did).
    """

    phase: str
    step: int
    instance_id: str
    repetition_id: int
    attempt: int
    prompt_index: int
    meta: dict[str, Any]
    id: str | None = None
    status: str | None = None
    annotations: dict[str, Any] | None = None
    record: RecordLocation | None = None
    superseded: bool = False
    error: str | None = None
    dropped: bool = False
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None

    def row(self, trained: bool | None = None) -> dict[str, Any]:
        """This attempt as a row of a step index (docs/run-index.md "step.json"); `trained` as the
        trainer says.

        A superseded attempt and any attempt of the `eval` phase are never trained, whatever
        `trained` says.
        """
        if self.superseded or self.phase == "eval":
            trained = False
        return {
            "id": self.id,
            "instance_id": self.instance_id,
            "repetition_id": self.repetition_id,
            "attempt": self.attempt,
            "status": self.status,
            "annotations": self.annotations,
            "superseded": self.superseded,
            "trained": trained,
            "record": _location_json(self.record),
        }


def _location_json(location: RecordLocation | None) -> dict[str, Any] | None:
    """The finish answer's `record` object again (every field the client kept)."""
    if location is None:
        return None
    out: dict[str, Any] = {}
    for name in _LOCATION_FIELDS:
        value = getattr(location, name)
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


_LOCATION_FIELDS = tuple(f.name for f in dataclasses.fields(RecordLocation))


class RecordLog:
    """Attempts in the order they were opened; safe to read from another thread."""

    def __init__(self) -> None:
        self._entries: list[AttemptRecord] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def open(self, entry: AttemptRecord) -> AttemptRecord:
        """Add an attempt as it starts; the loop fills it in as the attempt goes on."""
        with self._lock:
            self._entries.append(entry)
        return entry

    def entries(self, phase: str | None = None, step: int | None = None) -> list[AttemptRecord]:
        """Attempts of a phase and step (None: any), in the order they were opened."""
        with self._lock:
            return [
                e
                for e in self._entries
                if (phase is None or e.phase == phase) and (step is None or e.step == step)
            ]

    def phases(self) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(e.phase for e in self._entries))

    def steps(self, phase: str) -> list[int]:
        with self._lock:
            return sorted({e.step for e in self._entries if e.phase == phase})

    def rows(
        self, phase: str, step: int, trained_ids: set[str] | None = None
    ) -> list[dict[str, Any]]:
        """The step's attempts as index rows (docs/run-index.md "step.json"), each trajectory once.

        `trained` is `id in trained_ids` when the trainer says which it trained, else None.
        Attempts no server accepted have no trajectory, and attempts of a dropped batch were
        never the trainer's: both are left out.
        """
        return [
            e.row(None if trained_ids is None else e.id in trained_ids)
            for e in self.entries(phase, step)
            if e.id is not None and not e.dropped
        ]

    def discard(
        self, phase: str, step: int | None = None, *, dropped: bool = False
    ) -> list[AttemptRecord]:
        """Remove and return a phase's attempts (of one step, or all): indexed or dropped.

        With `dropped`, only the attempts of dropped batches go (of any step when `step` is
        None): what a step index discards at the next step instead of indexing it.
        """
        with self._lock:
            kept, gone = [], []
            for e in self._entries:
                match = e.phase == phase and (step is None or e.step == step)
                match = match and (e.dropped or not dropped)
                (gone if match else kept).append(e)
            self._entries = kept
        return gone

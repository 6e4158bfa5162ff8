"""A trajectory's earlier replies by id, for a call that names one (Responses' statefulness).

Every call of a dialect with a `reply_id_key` records its reply's id under that key on
its model node, so a later call naming the id continues from that node: its history is
the path to the node, and it hashes, renders and bridges exactly as if the client had
sent the whole history. The dialect's `prepare` decides what it does with it.
"""

from __future__ import annotations

from typing import Any

from skycap.graph import MODEL
from skycap.trajectory import Trajectory


class EarlierReplies:
    """The `Earlier` of one trajectory, its replies found under `key` (newest first)."""

    __slots__ = ("_trajectory", "_key")

    def __init__(self, trajectory: Trajectory, key: str | None) -> None:
        self._trajectory = trajectory
        self._key = key

    @property
    def trajectory_id(self) -> str:
        return self._trajectory.id

    def history(self, reply_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        if self._key is None:
            return None
        graph = self._trajectory.graph
        for node in reversed(graph.nodes):
            if node.author == MODEL:
                for call in node.calls:
                    if call.get(self._key) == reply_id:
                        return [graph[i].message for i in graph.path_to(node.id)], call
        return None

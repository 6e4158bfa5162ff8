"""The context graph: one node per message in a forest, deduplicated by delta hash
(graph.md §1, §2, §3).

The graph knows nothing of HTTP, modes or records. Callers compute hashes (skycap.hashing)
and token payloads; the graph places nodes, keeps the chosen sibling per match hash, walks
a request's hashes to its deepest matching prefix and lists root-to-leaf paths.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CLIENT = "client"
MODEL = "model"


@dataclass(slots=True, eq=False)
class Tokens:
    """A node's slice of what inference saw (token mode), held as numpy arrays.

    `logprobs` is None when the node has none (client nodes); model nodes hold 0.0 for
    scaffold positions. `mask_offsets` is None when no sampling mask was captured; rows are
    the node's sampled positions, in CSR form. `text`/`text_offsets` are filled when the
    record is written (or read back); `experts_placeholder` marks a last expert row that
    is a copy (memory only). `extra` holds the per-token arrays of sidecar kinds
    registered without a field of their own (skycap/record/sidecars.py), by field name.
    """

    ids: np.ndarray
    sampled_start: int | None = None
    logprobs: np.ndarray | None = None
    experts: np.ndarray | None = None
    mask_ids: np.ndarray | None = None
    mask_offsets: np.ndarray | None = None
    media: list[dict[str, Any]] = field(default_factory=list)
    text: bytes | None = None
    text_offsets: np.ndarray | None = None
    experts_placeholder: bool = False
    extra: dict[str, np.ndarray] | None = None

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int32)
        if self.logprobs is not None:
            self.logprobs = np.asarray(self.logprobs, dtype=np.float64)
        if self.mask_offsets is not None:
            self.mask_ids = np.asarray(
                self.mask_ids if self.mask_ids is not None else (), dtype=np.int32
            )
            self.mask_offsets = np.asarray(self.mask_offsets, dtype=np.int64)

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])

    @property
    def mask_rows(self) -> int:
        return 0 if self.mask_offsets is None else int(self.mask_offsets.shape[0]) - 1

    def mask_row_lists(self) -> list[list[int]] | None:
        if self.mask_offsets is None:
            return None
        ids, bounds = self.mask_ids.tolist(), self.mask_offsets.tolist()
        return [ids[bounds[r] : bounds[r + 1]] for r in range(len(bounds) - 1)]


@dataclass(slots=True, eq=False)
class Node:
    """One message. `calls` is non-empty exactly for model nodes."""

    id: int
    parent: int | None
    depth: int
    role: str | None
    author: str
    message: dict[str, Any]
    match_hash: str
    delta_hash: str
    created_at: float
    calls: list[dict[str, Any]] = field(default_factory=list)
    tokens: Tokens | None = None
    children: list[int] = field(default_factory=list)

    @property
    def is_model(self) -> bool:
        return self.author == MODEL


class Graph:
    """A forest of message nodes; `add` is its only mutation."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.roots: list[int] = []
        self._by_delta: dict[tuple[int | None, str], int] = {}
        self._by_match: dict[tuple[int | None, str], list[int]] = {}
        self._chosen: dict[tuple[int | None, str], int] = {}
        # Token-mode respellings: (parent, request match hash) -> node (memory only).
        self.aliases: dict[tuple[int | None, str], int] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def children(self, parent: int | None) -> list[int]:
        return self.roots if parent is None else self.nodes[parent].children

    def add(
        self,
        parent: int | None,
        *,
        author: str,
        message: dict[str, Any],
        match_hash: str,
        delta_hash: str,
        created_at: float,
        tokens: Tokens | None = None,
    ) -> Node:
        """Return the child of `parent` with this delta hash, or append a new one."""
        existing = self._by_delta.get((parent, delta_hash))
        if existing is not None:
            return self.nodes[existing]
        if author not in (CLIENT, MODEL):
            raise ValueError(f"node author must be 'client' or 'model', got {author!r}")
        if parent is not None and not 0 <= parent < len(self.nodes):
            raise ValueError(f"parent {parent} is not a node of this graph")
        role = message.get("role")
        node = Node(
            id=len(self.nodes),
            parent=parent,
            depth=0 if parent is None else self.nodes[parent].depth + 1,
            role=role if isinstance(role, str) else None,
            author=author,
            message=message,
            match_hash=match_hash,
            delta_hash=delta_hash,
            created_at=created_at,
            tokens=tokens,
        )
        self.nodes.append(node)
        self.children(parent).append(node.id)
        self._by_delta[(parent, delta_hash)] = node.id
        key = (parent, match_hash)
        self._by_match.setdefault(key, []).append(node.id)
        chosen = self._chosen.get(key)
        if chosen is None or node.is_model or not self.nodes[chosen].is_model:
            self._chosen[key] = node.id
        return node

    def chosen(self, parent: int | None, match_hash: str) -> int | None:
        return self._chosen.get((parent, match_hash))

    def shadowed_by(self, node: Node) -> int | None:
        chosen = self._chosen[(node.parent, node.match_hash)]
        return None if chosen == node.id else chosen

    def with_match(self, parent: int | None, match_hash: str) -> list[int]:
        """Children of `parent` (or roots) with this match hash, oldest first."""
        return self._by_match.get((parent, match_hash), [])

    def _candidates(self, parent: int | None, match_hash: str) -> list[int]:
        found = self._by_match.get((parent, match_hash), [])
        alias = self.aliases.get((parent, match_hash))
        if alias is not None and alias not in found:
            return [*found, alias]
        return found

    def walk(self, hashes: Sequence[str], start: int | None = None) -> list[int]:
        """The deepest matching prefix of `hashes` from `start` (graph.md §1), as node ids.

        Straight runs (one candidate) are followed in a loop; only real ties recurse, so
        long conversations cost O(length) and do not hit the recursion limit.
        """
        path: list[int] = []
        current = start
        index = 0
        while index < len(hashes):
            candidates = self._candidates(current, hashes[index])
            if not candidates:
                break
            if len(candidates) == 1:
                best = candidates[0]
            else:
                best = self._best_candidate(current, candidates, hashes, index)
            path.append(best)
            current = best
            index += 1
        return path

    def _best_candidate(
        self, parent: int | None, candidates: list[int], hashes: Sequence[str], index: int
    ) -> int:
        chosen = self._chosen.get((parent, hashes[index]))
        depths = {c: len(self.walk(hashes[index + 1 :], start=c)) for c in candidates}
        deepest = max(depths.values())
        tied = [c for c in candidates if depths[c] == deepest]
        return chosen if chosen in tied else max(tied)

    def leaves(self) -> list[int]:
        return [node.id for node in self.nodes if not node.children]

    def path_to(self, node_id: int) -> list[int]:
        """Node ids from the root down to `node_id`."""
        path = []
        current: int | None = node_id
        while current is not None:
            path.append(current)
            current = self.nodes[current].parent
        path.reverse()
        return path

    def paths(self) -> list[list[int]]:
        """Root-to-leaf paths, ordered by leaf id."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    def branch_points(self) -> list[int]:
        return [node.id for node in self.nodes if len(node.children) > 1]

    def calls(self) -> Iterator[dict[str, Any]]:
        for node in self.nodes:
            yield from node.calls

    def node_json(self, node: Node) -> dict[str, Any]:
        """The node's document fields without `tokens` (format.md §4 order)."""
        return {
            "id": node.id,
            "parent": node.parent,
            "depth": node.depth,
            "role": node.role,
            "author": node.author,
            "message": node.message,
            "match_hash": node.match_hash,
            "delta_hash": node.delta_hash,
            "created_at": node.created_at,
            "calls": node.calls,
            "shadowed_by": self.shadowed_by(node),
        }

"""What a sidecar kind is: the one interface the writer, reader, journal, validator and samples ask.

A kind owns its arrays (the columns of its payload, docs/format.md's "Sidecars"), the keys
it adds to a node's `tokens` object, the `Tokens` attributes it fills, how a record's nodes are
collected into its payload, how a node's slice is read back, how a trajectory's path is
sliced into a sample, and the validation rules that are its own. `skycap/record/sidecars.py`
holds the registry, so the code reading and writing records names no kind beyond `tokens`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import orjson

from skycap.graph import Node, Tokens
from skycap.record.layout import Column, RecordError

# Stands for a key the document does not have, so `show` can say so.
ABSENT = object()

Arrays = Mapping[str, np.ndarray]
OpenSidecar = Callable[[], "dict[str, np.ndarray] | None"]


def show(value: Any) -> str:
    """A value inside a problem text: as JSON (strings quoted), `absent` for a missing key."""
    return orjson.dumps(value).decode() if value is not ABSENT else "absent"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def node_specs(document: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Each node's `tokens` object, `{}` where it has none or the document is malformed."""
    return [as_dict(as_dict(n).get("tokens")) for n in as_list(document.get("nodes"))]


def rows_outside(
    document: Mapping[str, Any], offset_key: str, count_key: str, total: int, what: str
) -> list[str]:
    """Each node whose rows `[offset, offset + count)` do not fit a sidecar of `total` rows."""
    problems = []
    for i, tokens in enumerate(node_specs(document)):
        start, count = tokens.get(offset_key), tokens.get(count_key)
        if is_int(start) and is_int(count) and not 0 <= start <= start + count <= total:
            problems.append(
                f"node {i} {what} [{start}, {start + count}) outside the {total}-row sidecar"
            )
    return problems


def array_shape0(entry: Any, name: str) -> int | None:
    """The first dimension a manifest entry lists for array `name`, or None."""
    shape = as_dict(as_dict(as_dict(entry).get("arrays")).get(name)).get("shape")
    return shape[0] if isinstance(shape, list) and shape and is_int(shape[0]) else None


class NodeFields:
    """Checked reads of one node's `tokens` object, errors naming the node."""

    def __init__(self, index: int, spec: dict[str, Any]) -> None:
        self.index = index
        self.spec = spec

    def count(self, key: str) -> int:
        value = self.spec.get(key)
        if not (type(value) is int and value >= 0):
            raise RecordError(
                f"node {self.index}: tokens.{key} must be a non-negative integer, got {value!r}"
            )
        return value

    def slice(self, array: np.ndarray, start: int, count: int, what: str) -> np.ndarray:
        if start + count > array.shape[0]:
            raise RecordError(
                f"node {self.index}: {what} [{start}, {start + count}) outside the "
                f"{array.shape[0]}-entry sidecar array"
            )
        return array[start : start + count]


class Collector:
    """One record's pieces of one kind, gathered node by node as the writer walks the graph."""

    def add(self, node: Node, tokens: Tokens) -> dict[str, Any]:
        """The node's keys of this kind (in `tokens` object order), its arrays queued."""
        raise NotImplementedError

    def columns(self) -> list[Column] | None:
        """The payload's columns, or None when the record writes no sidecar of this kind."""
        raise NotImplementedError


class SidecarKind:
    """One sidecar kind. `fields` are the `Tokens` attributes it fills; a kind whose `own` is
    False keeps them in `Tokens.extra` under its field names instead of attributes of its own."""

    name: str
    arrays: tuple[str, ...]  # the arrays its manifest entry must list
    fields: tuple[str, ...]
    sample_key: str | None = None  # the sample's array of this kind (BuiltSample, wire)
    own = True

    def collector(self, trajectory_id: str) -> Collector:
        raise NotImplementedError

    def load(self, fields: NodeFields, open_sidecar: OpenSidecar) -> dict[str, Any]:
        """The node's `Tokens` values of this kind from its slice, sidecars opened on demand."""
        raise NotImplementedError

    def slices(self, spec: Mapping[str, Any]) -> bool:
        """Whether a node's `tokens` object slices into this kind's sidecar."""
        raise NotImplementedError

    def manifest_problems(self, document: Mapping[str, Any], entry: Any) -> list[str]:
        """The manifest rules of this kind: its listed arrays against what the nodes cover."""
        return []

    def problems(self, document: Mapping[str, Any], arrays: Arrays) -> list[str]:
        """The decoded payload against the nodes that slice into it."""
        return []

    def sample(
        self,
        nodes: list[Node],
        tokens: list[Tokens],
        starts: np.ndarray,
        targets: set[int],
        loss_mask: np.ndarray,
    ) -> Any:
        """This kind's array of one sample (a path), or None when the path cannot carry it."""
        return None

    def encode(self, value: Any) -> Any:
        """The sample array as the finish wire carries it (docs/graph.md's "Per-sample arrays
        and their encoding")."""
        return value

    def get(self, tokens: Tokens, field: str) -> Any:
        if self.own:
            return getattr(tokens, field)
        return None if tokens.extra is None else tokens.extra.get(field)

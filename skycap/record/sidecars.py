"""The sidecar kinds, one entry each, in one registry: tokens, routed experts, sampling masks.

The writer, reader, journal, validator, summary and samples read this registry, so a new
per-token sidecar is one entry here plus its `Tokens` field (`skycap/graph.py`; none for a
kind kept in `Tokens.extra`) and the engine wire's parse that fills `EngineOutput.extra`;
see docs/architecture.md's "Sidecar kinds". `KINDS` lists the names in kind order: the
order files are written and listed (docs/format.md's "Write protocol").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from skycap.arrays import pack
from skycap.graph import Node, Tokens
from skycap.record.layout import Column, RecordError, little_endian
from skycap.record.sidecar_kind import (
    Arrays,
    Collector,
    NodeFields,
    OpenSidecar,
    SidecarKind,
    array_shape0,
    is_int,
    node_specs,
    rows_outside,
    show,
)
from skycap.record.tokens_kind import TokensKind

# -- rows: one array row per token (routed experts, and the shape a new kind most often has) --


class _RowsCollector(Collector):
    def __init__(self, kind: RowsKind) -> None:
        self.kind = kind
        self.pieces: list[np.ndarray] = []
        self.dtype: np.dtype | None = None
        self.cursor = 0

    def add(self, node: Node, tokens: Tokens) -> dict[str, Any]:
        kind = self.kind
        rows = kind.get(tokens, kind.field)
        if rows is None:
            return {kind.offset_key: None, kind.rows_key: 0}
        if rows.ndim != 1 + len(kind.item_names) or rows.shape[0] != tokens.length:
            raise ValueError(
                f"node {node.id}: {kind.what} of shape {rows.shape} for {tokens.length} "
                f"tokens; expected {kind.expected(tokens.length)}"
            )
        if self.dtype is None:
            # The first array fixes the column's dtype and row shape; later ones cast.
            self.dtype = little_endian(rows.dtype, f"node {node.id} {kind.what}")
        elif rows.shape[1:] != self.pieces[0].shape[1:]:
            raise ValueError(
                f"node {node.id}: {kind.what} {kind.item_label()} = {rows.shape[1:]} differ "
                f"from the first node's {self.pieces[0].shape[1:]}"
            )
        entry = {kind.offset_key: self.cursor, kind.rows_key: tokens.length}
        self.pieces.append(rows)
        self.cursor += tokens.length
        return entry

    def columns(self) -> list[Column] | None:
        if self.dtype is None:
            return None
        item_shape = tuple(int(n) for n in self.pieces[0].shape[1:])
        return [Column(self.kind.array, self.dtype, self.pieces, item_shape)]


class RowsKind(SidecarKind):
    """A kind holding one array with a row per token of the nodes that have it.

    `field` is the `Tokens` attribute (or, with `own=False`, the `Tokens.extra` key) the
    rows live in; `item_names` name the axes of a row (`layers, k` for routed experts).
    A sample carries the rows concatenated when every node of its path has them.
    """

    def __init__(
        self,
        name: str,
        *,
        array: str,
        field: str,
        offset_key: str,
        rows_key: str,
        item_names: tuple[str, ...] = (),
        what: str | None = None,
        sample_key: str | None = None,
        own: bool = True,
    ) -> None:
        self.name = name
        self.array = array
        self.arrays = (array,)
        self.field = field
        self.fields = (field,)
        self.offset_key = offset_key
        self.rows_key = rows_key
        self.item_names = item_names
        self.what = what or name
        self.sample_key = sample_key
        self.own = own

    def expected(self, length: int | str) -> str:
        return "[" + ", ".join([str(length), *self.item_names]) + "]"

    def item_label(self) -> str:
        return "(" + ", ".join(self.item_names) + ")"

    def collector(self, trajectory_id: str) -> Collector:
        return _RowsCollector(self)

    def load(self, fields: NodeFields, open_sidecar: OpenSidecar) -> dict[str, Any]:
        if fields.spec.get(self.offset_key) is None:
            return {self.field: None}
        arrays = open_sidecar()
        if arrays is None:
            return {self.field: None}
        rows = arrays[self.array]
        if rows.ndim != 1 + len(self.item_names):
            raise RecordError(
                f"{self.array} has shape {list(rows.shape)}; expected {self.expected('rows')}"
            )
        start, count = fields.count(self.offset_key), fields.count(self.rows_key)
        return {self.field: fields.slice(rows, start, count, self.name)}

    def slices(self, spec: Mapping[str, Any]) -> bool:
        return spec.get(self.offset_key) is not None

    def problems(self, document: Mapping[str, Any], arrays: Arrays) -> list[str]:
        """[rows, *item] and every node's rows inside."""
        rows = arrays.get(self.array)
        if rows is None:
            return []
        if rows.ndim != 1 + len(self.item_names):
            return [f"{self.array} has shape {list(rows.shape)}; expected {self.expected('rows')}"]
        return rows_outside(document, self.offset_key, self.rows_key, rows.shape[0], self.name)

    def sample(
        self,
        nodes: list[Node],
        tokens: list[Tokens],
        starts: np.ndarray,
        targets: set[int],
        loss_mask: np.ndarray,
    ) -> np.ndarray | None:
        """Rows concatenated, only if every node has one row per token."""
        arrays = [self.get(t, self.field) for t in tokens]
        if any(
            a is None or a.ndim != 1 + len(self.item_names) or a.shape[0] != t.length
            for a, t in zip(arrays, tokens, strict=True)
        ):
            return None
        return np.concatenate(arrays)

    def encode(self, value: Any) -> Any:
        return None if value is None else pack(value)


# -- sampling masks: CSR rows of the allowed token ids, one per sampled position -------------


class _MaskCollector(Collector):
    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self.row_cursor = 0
        self.id_cursor = 0

    def add(self, node: Node, tokens: Tokens) -> dict[str, Any]:
        bounds = tokens.mask_offsets
        if bounds is None:
            return {"mask_offset": None, "mask_rows": 0}
        if (
            bounds.ndim != 1
            or bounds.shape[0] < 1
            or bounds[0] < 0
            or bounds[-1] > tokens.mask_ids.shape[0]
            or np.any(np.diff(bounds) < 0)
        ):
            raise ValueError(
                f"node {node.id}: sampling-mask offsets {bounds.tolist()} are not CSR bounds "
                f"over {tokens.mask_ids.shape[0]} ids"
            )
        rows = tokens.mask_rows
        entry = {"mask_offset": self.row_cursor, "mask_rows": rows}
        if rows:
            start, end = int(bounds[0]), int(bounds[-1])
            self.ids.append(tokens.mask_ids[start:end])
            self.offsets.append(bounds[1:] - start + self.id_cursor)
            self.id_cursor += end - start
            self.row_cursor += rows
        return entry

    def columns(self) -> list[Column] | None:
        if (
            self.row_cursor == 0
        ):  # an all-empty mask writes no sidecar (docs/format.md's "Sidecars")
            return None
        return [Column("ids", np.int32, self.ids), Column("offsets", np.int64, self.offsets)]


class MaskKind(SidecarKind):
    """The engine's sampling masks: the token ids allowed at each sampled position."""

    name = "sampling_mask"
    arrays = ("ids", "offsets")
    fields = ("mask_ids", "mask_offsets")
    sample_key = "sampling_mask"

    def collector(self, trajectory_id: str) -> Collector:
        return _MaskCollector()

    def load(self, fields: NodeFields, open_sidecar: OpenSidecar) -> dict[str, Any]:
        """The node's CSR mask rows; `mask_rows: 0` never opens the sidecar (docs/format.md's
        "Reader rules")."""
        if fields.spec.get("mask_offset") is None:
            return {"mask_ids": None, "mask_offsets": None}
        start, rows = fields.count("mask_offset"), fields.count("mask_rows")
        if rows == 0:
            return {"mask_ids": np.zeros(0, dtype=np.int32), "mask_offsets": np.zeros(1, np.int64)}
        mask = open_sidecar()
        if mask is None:
            return {"mask_ids": None, "mask_offsets": None}
        bounds = fields.slice(mask["offsets"], start, rows + 1, "sampling-mask offsets")
        first, last = int(bounds[0]), int(bounds[-1])
        if last < first:
            raise RecordError(f"node {fields.index}: sampling-mask offsets decrease")
        return {
            "mask_ids": fields.slice(mask["ids"], first, last - first, "sampling-mask ids"),
            "mask_offsets": bounds - first,
        }

    def slices(self, spec: Mapping[str, Any]) -> bool:
        return (
            spec.get("mask_offset") is not None
            and is_int(spec.get("mask_rows"))
            and spec["mask_rows"] > 0
        )

    def manifest_problems(self, document: Mapping[str, Any], entry: Any) -> list[str]:
        rows = sum(
            t["mask_rows"]
            for t in node_specs(document)
            if t.get("mask_offset") is not None and is_int(t.get("mask_rows"))
        )
        found = array_shape0(entry, "offsets")
        if found != rows + 1:
            return [f"sampling_mask offsets has {show(found)} entries for {rows} rows"]
        return []

    def problems(self, document: Mapping[str, Any], arrays: Arrays) -> list[str]:
        """CSR offsets that rise within its ids, node rows inside."""
        ids, offsets = arrays.get("ids"), arrays.get("offsets")
        if ids is None or offsets is None:
            return []
        if offsets.ndim != 1 or offsets.shape[0] < 1:
            return [f"sampling_mask offsets has shape {list(offsets.shape)}"]
        if offsets[0] != 0 or offsets[-1] > ids.shape[0] or np.any(np.diff(offsets) < 0):
            return [f"sampling_mask offsets are not CSR bounds over its {ids.shape[0]} ids"]
        total = offsets.shape[0] - 1
        return rows_outside(document, "mask_offset", "mask_rows", total, "mask rows")

    def sample(
        self,
        nodes: list[Node],
        tokens: list[Tokens],
        starts: np.ndarray,
        targets: set[int],
        loss_mask: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """CSR over every position: targets' sampled positions get their rows, others `[]`
        (so does a sampled position the loss mask leaves out, one with no logprob)."""
        total = int(starts[-1])
        row_lengths = np.zeros(total, dtype=np.int64)
        id_parts = []
        for k, (node, tok) in enumerate(zip(nodes, tokens, strict=False)):
            if node.id not in targets:
                continue
            if tok.mask_offsets is None:
                return None
            bounds = tok.mask_offsets
            sampled_from = tok.length if tok.sampled_start is None else tok.sampled_start
            sampled = tok.length - sampled_from
            if tok.mask_rows != sampled:
                raise ValueError(
                    f"node {node.id} has {tok.mask_rows} sampling-mask rows "
                    f"for {sampled} sampled tokens"
                )
            first = int(starts[k]) + sampled_from
            lengths = np.diff(bounds)
            ids = tok.mask_ids[int(bounds[0]) : int(bounds[-1])]
            kept = loss_mask[first : first + sampled].astype(bool)
            if not kept.all():
                ids = ids[np.repeat(kept, lengths)]
                lengths = np.where(kept, lengths, 0)
            row_lengths[first : first + sampled] = lengths
            id_parts.append(ids)
        if not id_parts:
            return None
        offsets = np.zeros(total + 1, dtype=np.int64)
        np.cumsum(row_lengths, out=offsets[1:])
        return np.concatenate(id_parts).astype(np.int32, copy=False), offsets

    def encode(self, value: Any) -> Any:
        if value is None:
            return None
        ids, offsets = value
        return {"ids": ids.tolist(), "offsets": offsets.tolist()}


# -- the registry ----------------------------------------------------------------------------

TOKENS = TokensKind()
EXPERTS = RowsKind(
    "experts",
    array="routed_experts",
    field="experts",
    offset_key="experts_offset",
    rows_key="experts_rows",
    item_names=("layers", "k"),
    what="routed experts",
    sample_key="routed_experts",
)
SAMPLING_MASK = MaskKind()

REGISTRY: dict[str, SidecarKind] = {k.name: k for k in (TOKENS, EXPERTS, SAMPLING_MASK)}
# Kind names in kind order; a list kept in step with REGISTRY, so importers see new kinds.
KINDS: list[str] = list(REGISTRY)


def register(kind: SidecarKind) -> None:
    """Add a kind after the others (its files are written and listed last)."""
    if kind.name in REGISTRY:
        raise ValueError(f"sidecar kind {kind.name!r} is already registered")
    REGISTRY[kind.name] = kind
    KINDS.append(kind.name)


def unregister(name: str) -> None:
    """Remove a kind `register` added (the built-in three stay)."""
    if REGISTRY.get(name) in (TOKENS, EXPERTS, SAMPLING_MASK):
        raise ValueError(f"sidecar kind {name!r} is built in")
    del REGISTRY[name]
    KINDS.remove(name)


def kind_order(kind: str) -> tuple[int, str]:
    """Sort key: registered kinds in kind order, then unknown ones by name."""
    return (KINDS.index(kind) if kind in KINDS else len(KINDS), kind)


def attached() -> list[SidecarKind]:
    """The kinds after tokens: a node slices into them only if it has tokens."""
    return [REGISTRY[name] for name in KINDS[1:]]

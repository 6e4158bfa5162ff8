"""The tokens sidecar kind: token ids, logprobs and decoded text, the kind every token node has.

It is the first entry of the registry in `skycap/record/sidecars.py`; a record without it
has no tokens at all (message text only).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from skycap.graph import Node, Tokens
from skycap.record.layout import Column
from skycap.record.sidecar_kind import (
    ABSENT,
    Arrays,
    Collector,
    NodeFields,
    OpenSidecar,
    SidecarKind,
    array_shape0,
    as_dict,
    as_list,
    is_int,
    node_specs,
    show,
)

# The tokens kind's warnings are the writer's: a node written without its text.
logger = logging.getLogger("skycap.record.writer")

TOKEN_ARRAYS = ("token_ids", "logprobs", "text_offsets", "text")


def text_problem(length: int, text: bytes, offsets: np.ndarray | None) -> str | None:
    """Why per-token text offsets cannot be written, or None (docs/format.md's "Manifest
    and payload")."""
    if offsets is None:
        return "text without per-token offsets"
    if offsets.shape != (length,):
        return f"{offsets.size} text offsets for {length} tokens"
    if length == 0:
        return None
    if offsets[0] < 0:
        return f"first text offset {int(offsets[0])} is negative"
    if offsets[-1] > len(text):
        return f"last text offset {int(offsets[-1])} is past the text's {len(text)} bytes"
    if np.any(np.diff(offsets) < 0):
        return "text offsets decrease"
    return None


def warn_no_text(trajectory_id: str, node: Node, reason: str) -> None:
    logger.warning("%s node %d: text not recorded: %s", trajectory_id, node.id, reason)


class _TokensCollector(Collector):
    def __init__(self, trajectory_id: str) -> None:
        self.trajectory_id = trajectory_id
        self.has_tokens = False
        self.ids: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []
        self.text_offsets: list[np.ndarray] = []
        self.text: list[np.ndarray] = []
        self.token_cursor = 0
        self.text_cursor = 0
        # Shared fill values, sliced per node instead of allocated per node.
        self._nan = np.empty(0, dtype=np.float64)
        self._zeros = np.empty(0, dtype=np.int32)

    def add(self, node: Node, tokens: Tokens) -> dict[str, Any]:
        self.has_tokens = True
        length = tokens.length
        entry = {
            "offset": self.token_cursor,
            "length": length,
            "sampled_start": None if tokens.sampled_start is None else int(tokens.sampled_start),
            "has_logprobs": self._add_logprobs(node, tokens),
            **self._add_text(node, tokens),
        }
        self.ids.append(tokens.ids)
        self.token_cursor += length
        return entry

    def _add_logprobs(self, node: Node, tokens: Tokens) -> bool:
        if tokens.logprobs is None:
            self.logprobs.append(self._fill_nan(tokens.length))
            return False
        if tokens.logprobs.shape != (tokens.length,):
            raise ValueError(
                f"node {node.id}: logprobs of shape {tokens.logprobs.shape} for "
                f"{tokens.length} tokens"
            )
        self.logprobs.append(tokens.logprobs)
        return True

    def _add_text(self, node: Node, tokens: Tokens) -> dict[str, Any]:
        if tokens.text is None:
            self.text_offsets.append(self._fill_zeros(tokens.length))
            return {"text_offset": None, "text_bytes": 0}
        offsets = None if tokens.text_offsets is None else np.asarray(tokens.text_offsets)
        problem = text_problem(tokens.length, tokens.text, offsets)
        if problem is not None:
            warn_no_text(self.trajectory_id, node, problem)
            self.text_offsets.append(self._fill_zeros(tokens.length))
            return {"text_offset": None, "text_bytes": 0}
        entry = {"text_offset": self.text_cursor, "text_bytes": len(tokens.text)}
        self.text_offsets.append(offsets)
        self.text.append(np.frombuffer(tokens.text, dtype=np.uint8))
        self.text_cursor += len(tokens.text)
        return entry

    def columns(self) -> list[Column] | None:
        if not self.has_tokens:
            return None
        return [
            Column("token_ids", np.int32, self.ids),
            Column("logprobs", np.float64, self.logprobs),
            Column("text_offsets", np.int32, self.text_offsets),
            Column("text", np.uint8, self.text),
        ]

    def _fill_nan(self, length: int) -> np.ndarray:
        if self._nan.shape[0] < length:
            self._nan = np.full(max(length, 2 * self._nan.shape[0]), np.nan)
        return self._nan[:length]

    def _fill_zeros(self, length: int) -> np.ndarray:
        if self._zeros.shape[0] < length:
            self._zeros = np.zeros(max(length, 2 * self._zeros.shape[0]), dtype=np.int32)
        return self._zeros[:length]


class TokensKind(SidecarKind):
    """The token ids, logprobs and text of every token node; a record without it has no tokens."""

    name = "tokens"
    arrays = TOKEN_ARRAYS
    fields = ("ids", "logprobs", "text_offsets")

    def collector(self, trajectory_id: str) -> Collector:
        return _TokensCollector(trajectory_id)

    def load(self, fields: NodeFields, open_sidecar: OpenSidecar) -> dict[str, Any]:
        tokens = open_sidecar()
        assert tokens is not None  # the reader reads no token node without this kind
        spec = fields.spec
        offset, length = fields.count("offset"), fields.count("length")
        ids = fields.slice(tokens["token_ids"], offset, length, "tokens")
        logprobs = fields.slice(tokens["logprobs"], offset, length, "tokens")
        text = text_offsets = None
        if spec.get("text_offset") is not None:
            text_offset, text_bytes = fields.count("text_offset"), fields.count("text_bytes")
            text = fields.slice(tokens["text"], text_offset, text_bytes, "text").tobytes()
            text_offsets = fields.slice(tokens["text_offsets"], offset, length, "tokens")
        sampled_start = spec.get("sampled_start")
        if sampled_start is not None:
            sampled_start = fields.count("sampled_start")
        return {
            "ids": ids,
            "sampled_start": sampled_start,
            "logprobs": logprobs if spec.get("has_logprobs") is True else None,
            "text": text,
            "text_offsets": text_offsets,
        }

    def slices(self, spec: Mapping[str, Any]) -> bool:
        return True

    def manifest_problems(self, document: Mapping[str, Any], entry: Any) -> list[str]:
        problems = []
        tokens = node_specs(document)
        covered = sum(t["length"] for t in tokens if is_int(t.get("length")))
        found = array_shape0(entry, "token_ids")
        if found != covered:
            problems.append(f"tokens sidecar has {show(found)} tokens, nodes cover {covered}")
        text = sum(t["text_bytes"] for t in tokens if is_int(t.get("text_bytes")))
        found = array_shape0(entry, "text")
        if found != text:
            problems.append(f"tokens sidecar has {show(found)} text bytes, nodes cover {text}")
        for name, array in as_dict(as_dict(entry).get("arrays")).items():
            offset = as_dict(array).get("offset", ABSENT)
            if not is_int(offset) or offset % 8:
                problems.append(f"tokens.{name} offset {show(offset)} not a multiple of 8")
        return problems

    def problems(self, document: Mapping[str, Any], arrays: Arrays) -> list[str]:
        """Rule 14 per node, against the decoded tokens sidecar."""
        if any(name not in arrays for name in TOKEN_ARRAYS):
            return []
        n = arrays["token_ids"].shape[0]
        text = arrays["text"].reshape(-1).view(np.uint8)
        problems = []
        for i, node in enumerate(as_list(document.get("nodes"))):
            tokens = as_dict(as_dict(node).get("tokens"))
            offset, length = tokens.get("offset"), tokens.get("length")
            if not is_int(offset) or not is_int(length):
                continue
            if offset < 0 or offset + length > n:
                problems.append(
                    f"node {i} tokens [{offset}, {offset + length}) outside the {n}-token sidecar"
                )
                continue
            text_offset, text_bytes = tokens.get("text_offset"), tokens.get("text_bytes")
            if is_int(text_offset) and is_int(text_bytes):
                if text_offset < 0 or text_offset + text_bytes > text.shape[0]:
                    problems.append(
                        f"node {i} text [{text_offset}, {text_offset + text_bytes}) outside the "
                        f"{text.shape[0]}-byte text"
                    )
                else:
                    own = text[text_offset : text_offset + text_bytes]
                    starts = arrays["text_offsets"][offset : offset + length].astype(np.int64)
                    problem = _span_problem(i, own, starts, text_bytes)
                    if problem:
                        problems.append(problem)
            start = tokens.get("sampled_start")
            if as_dict(node).get("author") == "model" and tokens.get("has_logprobs") is True:
                if is_int(start) and 0 <= start <= length:
                    scaffold = arrays["logprobs"][offset : offset + start]
                    bad = np.flatnonzero(~(np.isnan(scaffold) | (scaffold == 0)))
                    if bad.size:
                        k = int(bad[0])
                        problems.append(
                            f"node {i}: scaffold token {k} logprob {float(scaffold[k])!r}, "
                            "expected 0 or NaN"
                        )
        return problems


def _is_continuation(text: np.ndarray, positions: np.ndarray) -> np.ndarray:
    inside = positions < text.shape[0]
    found = np.zeros(positions.shape, dtype=bool)
    found[inside] = (text[positions[inside]] & 0xC0) == 0x80
    return found


def _span_problem(i: int, text: np.ndarray, starts: np.ndarray, text_bytes: int) -> str | None:
    """The first token of a node whose text span is out of order, out of range or not whole."""
    if not starts.size:
        return None
    ends = np.append(starts[1:], text_bytes)
    bad = np.flatnonzero((starts < 0) | (ends < starts) | (ends > text_bytes))
    if bad.size:
        k = int(bad[0])
        return f"node {i} token {k} span [{starts[k]}, {ends[k]}) is outside or out of order"
    try:
        text.tobytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        k = int(np.searchsorted(ends, exc.start, side="right"))
        return f"node {i} token {min(k, starts.size - 1)} span is not whole UTF-8 characters"
    nonempty = ends > starts
    cut = nonempty & (_is_continuation(text, starts) | _is_continuation(text, ends))
    bad = np.flatnonzero(cut)
    if bad.size:
        return f"node {i} token {int(bad[0])} span is not whole UTF-8 characters"
    return None

"""The record rules of `skycap validate` as problem lines, for the command and the viewer.

Documents are read here (not through the record reader) because the rules name zstd
framing faults by byte offset and count frames (R1, rule 17), which a plain decompressor
hides. Values inside problem texts are shown as JSON (strings quoted); a missing key shows
as `absent`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import zstandard

from skycap.record.frames import FrameError, content_size_problem, zstd_frames
from skycap.record.layout import DOCUMENT_SUFFIX, DTYPES, FORMAT_VERSION
from skycap.record.sidecar_kind import ABSENT, show
from skycap.record.sidecars import KINDS, REGISTRY, TOKENS, attached, kind_order
from skycap.trajectory import STATUSES
from skycap.viewer.derive import as_dict, as_list, is_int, malformed_kinds
from skycap.weights import SpansError, read_spans

PROBLEMS_PER_LINE = 5
DEFAULT_LIMIT = 20


def decompress(data: bytes) -> tuple[bytes, int]:
    """The content of every zstd frame, concatenated, and the frame count."""
    frames = zstd_frames(data)
    if not frames:  # R1: an empty file holds no frame at all
        raise FrameError("not a zstd frame at byte 0")
    out = []
    for start, end in frames:
        frame = data[start:end]
        problem = content_size_problem(frame)
        if problem is not None:
            raise FrameError(f"{problem} (frame at byte {start})")
        try:
            # Verifies the frame's content checksum when it has one.
            out.append(zstandard.ZstdDecompressor().decompressobj().decompress(frame))
        except zstandard.ZstdError as exc:
            raise FrameError(f"corrupt zstd frame at byte {start}: {exc}") from exc
    return b"".join(out), len(frames)


def frames_problem(name: str, count: int) -> list[str]:
    return [] if count == 1 else [f"{name} has {count} zstd frames (format.md: one)"]


def parse_document(data: bytes, name: str) -> tuple[dict[str, Any] | None, list[str]]:
    """R1-R4 and rule 17 on a document file's bytes: (document or None, problems).

    A failure of R1-R4 is the document's single problem and leaves no document.
    """
    try:
        payload, count = decompress(data)
    except FrameError as exc:
        return None, [str(exc)]
    try:
        document = orjson.loads(payload)
    except orjson.JSONDecodeError:
        document = None
    if not isinstance(document, dict):
        return None, ["document is not a JSON object"]
    version = document.get("format_version", ABSENT)
    if not (is_int(version) or isinstance(version, float)) or version != FORMAT_VERSION:
        return None, [
            f"unsupported format_version {show(version)} (this reader knows {FORMAT_VERSION})"
        ]
    if not isinstance(document.get("nodes"), list):
        return None, ["document has no nodes array"]
    return document, frames_problem(name, count)


def read_document(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, [f"cannot read {path.name}: {exc.strerror}"]
    return parse_document(data, path.name)


def _node_rules(document: Mapping[str, Any]) -> list[str]:
    """Rules 3-11 over the nodes, in node order."""
    problems: list[str] = []
    nodes = as_list(document.get("nodes"))
    tools = as_dict(document.get("tools"))
    mode = as_dict(document.get("capture")).get("mode")
    token_cursor = text_cursor = 0
    for i, node in enumerate(nodes):
        if not isinstance(node, dict):
            problems.append(f"nodes[{i}] is not an object")
            continue
        if node.get("id", ABSENT) != i or not is_int(node.get("id")):
            problems.append(f"nodes[{i}].id is {show(node.get('id', ABSENT))}")
        parent = node.get("parent", ABSENT)
        if parent is None:
            expected_depth = 0
        elif is_int(parent) and 0 <= parent < i:
            parent_depth = as_dict(nodes[parent]).get("depth")
            expected_depth = parent_depth + 1 if is_int(parent_depth) else None
        else:
            problems.append(f"node {i} has parent {show(parent)}, not an earlier node")
            expected_depth = None
        depth = node.get("depth", ABSENT)
        if expected_depth is not None and (not is_int(depth) or depth != expected_depth):
            problems.append(f"node {i}: depth {show(depth)}, expected {expected_depth}")
        author = node.get("author", ABSENT)
        if author not in ("client", "model"):
            problems.append(f"node {i}: author {show(author)}")
        if not isinstance(node.get("message"), dict):
            problems.append(
                f"node {i}: message {show(node.get('message', ABSENT))} is not an object"
            )
        calls = node.get("calls")
        if author == "client" and as_list(calls):
            problems.append(f"node {i}: client node with calls")
        if author == "model" and not as_list(calls):
            problems.append(f"node {i}: model node without calls")
        shadow = node.get("shadowed_by")
        if shadow is not None and not _is_shadow_sibling(nodes, i, shadow):
            problems.append(
                f"node {i}: shadowed_by {show(shadow)} is not a sibling with the same match hash"
            )
        for call in as_list(calls):
            call = as_dict(call)
            key = call.get("tools")
            if key is not None and (not isinstance(key, str) or key not in tools):
                problems.append(f"node {i}: call tools {show(key)} not in document tools")
            if mode != "tokens" and call.get("bridged") is not None:
                problems.append(f"node {i}: bridged {show(call['bridged'])} in text mode")
            problems += _spans_rules(i, call, node.get("tokens"))
        tokens = node.get("tokens")
        if tokens is None:
            if mode == "tokens":
                problems.append(f"node {i}: token mode but tokens is null")
            continue
        if not isinstance(tokens, dict):
            problems.append(f"node {i}: tokens is not an object")
            continue
        token_cursor, text_cursor = _token_rules(
            problems, i, author, tokens, token_cursor, text_cursor
        )
    return problems


def _spans_rules(i: int, call: Mapping[str, Any], tokens: Any) -> list[str]:
    """A call's `weight_versions`: contiguous, in order, over exactly its completion (the
    node's sampled tokens, when the record has them)."""
    tokens = as_dict(tokens)
    length, start = tokens.get("length"), tokens.get("sampled_start")
    count = length - start if is_int(length) and is_int(start) else None
    try:
        read_spans(call.get("weight_versions"), count)
    except SpansError as exc:
        return [f"node {i}: call {exc}"]
    return []


def _is_shadow_sibling(nodes: list[Any], i: int, shadow: Any) -> bool:
    if not is_int(shadow) or not 0 <= shadow < len(nodes) or shadow == i:
        return False
    other, node = as_dict(nodes[shadow]), nodes[i]
    return other.get("parent") == node.get("parent") and (
        other.get("match_hash") == node.get("match_hash")
    )


def _token_rules(
    problems: list[str],
    i: int,
    author: Any,
    tokens: Mapping[str, Any],
    token_cursor: int,
    text_cursor: int,
) -> tuple[int, int]:
    """Rule 11 for one node; returns the advanced token and text cursors."""
    offset, length = tokens.get("offset", ABSENT), tokens.get("length", ABSENT)
    if not is_int(length) or length < 0:
        problems.append(f"node {i}: tokens length {show(length)}")
        length = 0
    if offset != token_cursor or not is_int(offset):
        problems.append(
            f"node {i}: tokens offset {show(offset)}, expected {token_cursor} (node order)"
        )
    text_offset = tokens.get("text_offset")
    if text_offset is not None and (text_offset != text_cursor or not is_int(text_offset)):
        problems.append(
            f"node {i}: text_offset {show(text_offset)}, expected {text_cursor} (node order)"
        )
    text_bytes = tokens.get("text_bytes")
    start = tokens.get("sampled_start", ABSENT)
    if author == "client" and start is not None:
        problems.append(f"node {i}: client node with sampled_start")
    if author == "model":
        if not is_int(start) or not 0 <= start <= length:
            problems.append(f"node {i}: sampled_start {show(start)} of {length}")
        elif tokens.get("mask_offset") is not None and tokens.get("mask_rows") != length - start:
            problems.append(
                f"node {i}: {show(tokens.get('mask_rows', ABSENT))} mask rows for "
                f"{length - start} sampled tokens"
            )
    if tokens.get("experts_offset") is not None and tokens.get("experts_rows") != length:
        problems.append(
            f"node {i}: {show(tokens.get('experts_rows', ABSENT))} expert rows for {length} tokens"
        )
    return token_cursor + length, text_cursor + (text_bytes if is_int(text_bytes) else 0)


def _manifest_rules(document: Mapping[str, Any]) -> list[str]:
    """Rules 12, 13, 15 and 16: the manifest against what the nodes cover."""
    problems: list[str] = []
    manifest = document.get("sidecars")
    if manifest is not None and not isinstance(manifest, dict):
        return ["sidecars is not an object"]
    manifest = as_dict(manifest)
    if "tokens" in manifest:
        problems += TOKENS.manifest_problems(document, manifest["tokens"])
    problems += [
        f"node {i} slices into {kind}, which is not in the sidecars manifest"
        for i, kind in malformed_kinds(document)
    ]
    problems += [f"unknown sidecar kind {show(k)}" for k in manifest if k not in KINDS]
    for kind in attached():
        if kind.name in manifest:
            problems += kind.manifest_problems(document, manifest[kind.name])
    return problems


def _samples_rules(document: Mapping[str, Any]) -> list[str]:
    """The recorded `samples` (format.md §4): rows of a leaf node and target node ids."""
    samples = document.get("samples")
    if samples is None:
        return []
    if not isinstance(samples, dict) or not isinstance(samples.get("rows"), list):
        return [f"samples {show(samples)[:60]} is not an object with a rows array"]
    count = len(as_list(document.get("nodes")))
    for r, row in enumerate(samples["rows"]):
        row = as_dict(row)
        leaf, targets = row.get("leaf", ABSENT), row.get("targets", ABSENT)
        if not (is_int(leaf) and 0 <= leaf < count):
            return [f"samples row {r}: leaf {show(leaf)} is not a node"]
        if not isinstance(targets, list) or not all(is_int(t) and 0 <= t < count for t in targets):
            return [f"samples row {r}: targets {show(targets)[:60]} are not node ids"]
    return []


def document_problems(document: Mapping[str, Any]) -> list[str]:
    """Rules 1-13, 15 and 16 and the samples field on a readable document, in rule order."""
    problems = [
        f"missing {key}" for key in ("id", "status", "nodes", "sidecars") if key not in document
    ]
    status = document.get("status", ABSENT)
    if status is not ABSENT and status not in STATUSES:
        problems.append(f"unknown status {show(status)}")
    return problems + _node_rules(document) + _manifest_rules(document) + _samples_rules(document)


def listed_files(document: Mapping[str, Any]) -> dict[str, str]:
    """kind -> the sidecar file name the manifest lists (bare names only)."""
    files = {}
    for kind, entry in as_dict(document.get("sidecars")).items():
        name = as_dict(entry).get("file")
        if isinstance(name, str) and name and os.path.basename(name) == name:
            files[kind] = name
    return files


def token_arrays(
    payload: bytes, entry: Mapping[str, Any], kind: str = "tokens"
) -> tuple[dict[str, np.ndarray], list[str]]:
    """A sidecar's arrays, viewed from the payload, and the problems that stop any."""
    arrays: dict[str, np.ndarray] = {}
    problems = []
    listed = as_dict(entry.get("arrays"))
    for name, spec in listed.items():
        spec = as_dict(spec)
        dtype, shape, offset = spec.get("dtype"), spec.get("shape"), spec.get("offset")
        if dtype not in DTYPES:
            problems.append(f"array {name}: unknown dtype {show(dtype)}")
            continue
        dt = np.dtype(dtype).newbyteorder("<")
        if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
            problems.append(f"array {name}: shape {show(shape)}")
            continue
        if not is_int(offset) or offset < 0 or offset % dt.itemsize:
            problems.append(f"array {name}: offset {show(offset)} not aligned to {dt.itemsize}")
            continue
        count = math.prod(shape)  # Python ints: a shape like [2**62, 4, 2] cannot wrap
        end = offset + count * dt.itemsize
        if end > len(payload):
            problems.append(
                f"array {name}: bytes [{offset}, {end}) outside the {len(payload)}-byte payload"
            )
            continue
        arrays[name] = np.frombuffer(payload, dtype=dt, count=count, offset=offset).reshape(shape)
    problems += [
        f"{kind} sidecar has no {name} array"
        for name in REGISTRY[kind].arrays
        if name not in listed
    ]
    return arrays, problems


def sidecar_problems(record_dir: Path, document: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Rules 14 and 17 over every sidecar file present, each decoded and its checksum
    verified: (problems, listed kinds not here)."""
    problems: list[str] = []
    missing = []
    manifest = as_dict(document.get("sidecars"))
    for kind, name in listed_files(document).items():
        path = record_dir / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            missing.append(kind)
            continue
        except OSError as exc:
            problems.append(f"cannot read {name}: {exc.strerror}")
            continue
        try:
            payload, count = decompress(data)
        except FrameError as exc:
            problems.append(f"{name}: {exc}")
            continue
        problems += frames_problem(name, count)
        if kind not in REGISTRY:
            continue  # an unknown kind is reported by the manifest rules
        arrays, array_problems = token_arrays(payload, as_dict(manifest[kind]), kind)
        problems += array_problems + REGISTRY[kind].problems(document, arrays)
    return problems, missing


def missing_sidecars(record_dir: Path, document: Mapping[str, Any]) -> list[str]:
    """Listed kinds whose file is not beside the document (rule 18: read as absent)."""
    return [
        kind for kind, name in listed_files(document).items() if not (record_dir / name).exists()
    ]


def problem_line(doc_id: str, problems: list[str]) -> str:
    """`<id>: p1; p2; p3; p4; p5 (+k)`."""
    shown = "; ".join(problems[:PROBLEMS_PER_LINE])
    extra = len(problems) - PROBLEMS_PER_LINE
    return f"{doc_id}: {shown}" + (f" (+{extra})" if extra > 0 else "")


def document_ids(record_dir: Path) -> list[str]:
    """Top-level `*.json.zst` names without a leading dot, as ids, sorted (format.md §3)."""
    ids = []
    with os.scandir(record_dir) as entries:
        for entry in entries:
            name = entry.name
            if name.endswith(DOCUMENT_SUFFIX) and not name.startswith(".") and entry.is_file():
                ids.append(name[: -len(DOCUMENT_SUFFIX)])
    return sorted(ids)


@dataclass
class DirectoryReport:
    """One directory's outcome: problem lines (up to the limit) and the counts for its footer."""

    directory: str
    documents: int = 0
    bad: int = 0
    lines: list[str] = field(default_factory=list)
    missing: dict[str, int] = field(default_factory=dict)
    sidecars: bool = True

    def footer(self) -> list[str]:
        line = f"{self.directory}: {self.documents} documents, {self.bad} with problems"
        out = [line + ("" if self.sidecars else " (documents only)")]
        if self.missing:
            counts = ", ".join(
                f"{kind} {self.missing[kind]}" for kind in sorted(self.missing, key=kind_order)
            )
            out.append(f"{self.directory}: listed sidecar files not here, read as absent: {counts}")
        return out


def check_document(record_dir: Path, doc_id: str, *, sidecars: bool) -> tuple[list[str], list[str]]:
    """(problems, listed sidecar kinds not here) for one document."""
    document, problems = read_document(record_dir / f"{doc_id}{DOCUMENT_SUFFIX}")
    if document is None:
        return problems, []
    problems += document_problems(document)
    if not sidecars:
        return problems, missing_sidecars(record_dir, document)
    found, missing = sidecar_problems(record_dir, document)
    return problems + found, missing


def check_directory(
    record_dir: Path,
    *,
    sidecars: bool = True,
    limit: int = DEFAULT_LIMIT,
    ids: list[str] | None = None,
    on_document: Callable[[], None] | None = None,
) -> DirectoryReport:
    """Every document (or `ids`), and with `sidecars` (the default) every file it lists;
    `on_document` after each one."""
    report = DirectoryReport(directory=str(record_dir), sidecars=sidecars)
    for doc_id in document_ids(record_dir) if ids is None else ids:
        if on_document is not None:
            on_document()
        problems, missing = check_document(record_dir, doc_id, sidecars=sidecars)
        report.documents += 1
        for kind in missing:
            report.missing[kind] = report.missing.get(kind, 0) + 1
        if problems:
            report.bad += 1
            if len(report.lines) < limit:
                report.lines.append(problem_line(doc_id, problems))
    return report

"""Per-trajectory values the viewer derives from a record document
(docs/viewer.md "The rollout drawer", docs/viewer.md "Health band").

Everything here is a pure function of the document dict (plus, for `tokens-missing`,
whether the tokens file is beside it), so listing, flags and the `validate` command draw
the same conclusions without opening a sidecar. Documents may be malformed: these
functions never raise on odd field types; `validate` reports what is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from skycap.linearity import MalformedDocument, forks
from skycap.record.sidecars import REGISTRY

ERROR, WARN, INFO = "error", "warn", "info"

# docs/viewer.md "Health band", in display order: flag -> level.
FLAG_LEVELS: dict[str, str] = {
    "no-signal": WARN,
    "masked": WARN,
    "short": WARN,
    "retried": INFO,
    "malformed-record": ERROR,
    "tokens-missing": WARN,
    "failed-calls": ERROR,
    "incomplete": ERROR,
    "no-logprobs": ERROR,
    "unbridged": WARN,
    "unbridged-inferred": WARN,
    "unbridged-expected": INFO,
    "replayed": WARN,
    "no-train": WARN,
    "empty": WARN,
    "truncated": WARN,
    "abandoned": INFO,
    "forked": INFO,
    "bridged-unknown": INFO,
}
GROUP_FLAGS = ("no-signal", "masked", "short", "retried")
# Shown in the flag list of a trajectory but ignored by the health sort and table rows.
QUIET_FLAGS = frozenset({"bridged-unknown"})

GIVEN, REPLAYED, SCAFFOLD, SAMPLED, ELSEWHERE = (
    "given",
    "replayed",
    "scaffold",
    "sampled",
    "sampled-elsewhere",
)
TEXT_ONLY_WARNING = "tokens sidecar missing: showing message text only"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_number(value: Any) -> float | None:
    """A finite number from a number or a numeric string (a JS `Number()` reading), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str) and value.strip():
        try:
            number = float(value)
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def numeric_reward(value: Any) -> float | None:
    """docs/viewer.md "Health band": a finite number, or a boolean read as 0/1."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def as_dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def node_tokens(node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    tokens = node.get("tokens")
    return tokens if isinstance(tokens, dict) else None


def token_length(node: Mapping[str, Any]) -> int:
    tokens = node_tokens(node)
    length = tokens.get("length") if tokens else None
    return length if is_int(length) and length > 0 else 0


def is_model(node: Mapping[str, Any]) -> bool:
    return node.get("author") == "model"


def scaffold_length(node: Mapping[str, Any], length: int) -> int:
    """A model node's leading scaffold, clamped into [0, length] so odd records still draw."""
    tokens = node_tokens(node)
    start = tokens.get("sampled_start") if tokens else None
    return min(max(start, 0), length) if is_int(start) else 0


def calls_of(node: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [call for call in as_list(node.get("calls")) if isinstance(call, dict)]


def message_text(message: Any) -> str:
    """The text a reader sees of a message: reasoning, content parts and tool calls."""
    message = as_dict(message)
    parts: list[str] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        parts.append(f"<think>\n{reasoning}\n</think>")
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            part = as_dict(part)
            if isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif part.get("type") == "opaque":  # kept as sent: name what it holds
                parts.append(f"[{as_dict(part.get('value')).get('type') or 'opaque'}]")
            elif part.get("type"):
                parts.append(f"[{part['type']}]")
    for call in as_list(message.get("tool_calls")):
        function = as_dict(as_dict(call).get("function"))
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = orjson.dumps(arguments).decode()
        parts.append(f"[tool call] {function.get('name')}({arguments})")
    return "\n".join(part for part in parts if part)


@dataclass(frozen=True, slots=True)
class PathCounts:
    tokens: int
    trainable: int
    logprobs: int


@dataclass(slots=True)
class Derived:
    """The graph shape of a document: valid parents, children, paths and targets.

    A parent that is not an earlier node is treated as absent (the node becomes a root),
    so every node lies on exactly the paths through it and nothing loops.
    """

    nodes: list[Mapping[str, Any]]
    parents: list[int | None]
    children: list[list[int]]
    paths: list[list[int]]
    targets: dict[int, int]
    token_mode: bool
    _counts: list[PathCounts] | None = None
    _unbridged: dict[int, str | None] | None = None

    @property
    def counts(self) -> list[PathCounts]:
        """Every path's counts (computed once: flags and listings both need them)."""
        if self._counts is None:
            self._counts = [path_counts(self, i) for i in range(len(self.paths))]
        return self._counts

    @property
    def branch_points(self) -> list[int]:
        return [i for i, kids in enumerate(self.children) if len(kids) > 1]

    def path_id(self, doc_id: str, index: int) -> str:
        return f"{doc_id}-p{index:04d}"


def capture_mode(document: Mapping[str, Any]) -> str | None:
    mode = as_dict(document.get("capture")).get("mode")
    return mode if isinstance(mode, str) else None


def derive(document: Mapping[str, Any]) -> Derived:
    """Paths (one per leaf, by leaf id) and targets (first path containing a model node)."""
    nodes = [n if isinstance(n, dict) else {} for n in as_list(document.get("nodes"))]
    parents: list[int | None] = []
    children: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        parent = node.get("parent")
        valid = is_int(parent) and 0 <= parent < i
        parents.append(parent if valid else None)
        if valid:
            children[parent].append(i)
    paths = []
    for leaf, kids in enumerate(children):
        if kids:
            continue
        path = []
        current: int | None = leaf
        while current is not None:
            path.append(current)
            current = parents[current]
        path.reverse()
        paths.append(path)
    targets: dict[int, int] = {}
    for index, path in enumerate(paths):
        for node_id in path:
            if is_model(nodes[node_id]) and node_id not in targets:
                targets[node_id] = index
    return Derived(
        nodes=nodes,
        parents=parents,
        children=children,
        paths=paths,
        targets=targets,
        token_mode=capture_mode(document) == "tokens",
    )


def path_counts(derived: Derived, index: int) -> PathCounts:
    """Tokens, trainable tokens and logprob count of one path
    (docs/viewer.md "The rollout drawer")."""
    tokens = trainable = logprobs = 0
    for node_id in derived.paths[index]:
        node = derived.nodes[node_id]
        length = token_length(node)
        tokens += length
        if derived.targets.get(node_id) == index:
            sampled = length - scaffold_length(node, length)
            trainable += sampled
            if as_dict(node_tokens(node)).get("has_logprobs") is True:
                logprobs += sampled
    return PathCounts(tokens, trainable, logprobs)


def uses_tokens(derived: Derived) -> bool:
    """Whether blocks can be measured in tokens: some node carries a `tokens` object."""
    return any(node_tokens(node) is not None for node in derived.nodes)


def path_blocks(derived: Derived, index: int, *, chars: bool = False) -> list[dict[str, Any]]:
    """The path cut into blocks at node boundaries and at `sampled_start`.

    See docs/viewer.md "The rollout drawer".

    Ranges are in the path's concatenated tokens, or with `chars` in characters of the
    nodes' message text (the text-only fallback; a model node then has no scaffold).
    Every node gets its main block even when empty; a scaffold block only when non-empty.
    """
    blocks: list[dict[str, Any]] = []
    cursor = 0
    for node_id in derived.paths[index]:
        node = derived.nodes[node_id]
        if chars:
            length, scaffold = len(message_text(node.get("message"))), 0
        else:
            length = token_length(node)
            scaffold = scaffold_length(node, length) if is_model(node) else 0
        if not is_model(node):
            kind = REPLAYED if node.get("role") == "assistant" else GIVEN
            blocks.append({"kind": kind, "node": node_id, "start": cursor, "end": cursor + length})
        else:
            if scaffold:
                blocks.append(
                    {"kind": SCAFFOLD, "node": node_id, "start": cursor, "end": cursor + scaffold}
                )
            trained_in = derived.targets.get(node_id, index)
            block = {"kind": SAMPLED, "node": node_id, "start": cursor + scaffold}
            block["end"] = cursor + length
            if trained_in != index:
                block["kind"] = ELSEWHERE
                block["trained_in"] = trained_in
            blocks.append(block)
        cursor += length
    return blocks


def strip(blocks: list[dict[str, Any]]) -> list[list[Any]]:
    """A mask strip: `[kind, length]` runs with neighbours of the same kind merged."""
    runs: list[list[Any]] = []
    for block in blocks:
        size = block["end"] - block["start"]
        if not size:
            continue
        if runs and runs[-1][0] == block["kind"]:
            runs[-1][1] += size
        else:
            runs.append([block["kind"], size])
    return runs


def retokenized_copies(derived: Derived) -> dict[int, int]:
    """Client node -> the model node whose `shadowed_by` names it a re-tokenized copy of."""
    found = {}
    for i, node in enumerate(derived.nodes):
        shadow = node.get("shadowed_by")
        if (
            not is_model(node)
            and is_int(shadow)
            and 0 <= shadow < len(derived.nodes)
            and is_model(derived.nodes[shadow])
        ):
            found[i] = shadow
    return found


def inferred_unbridged(derived: Derived) -> list[int]:
    """Model nodes whose client ancestors, up to the nearest model one, hold a re-tokenized copy."""
    copies = retokenized_copies(derived)
    found = []
    for i, node in enumerate(derived.nodes):
        if not is_model(node):
            continue
        current = derived.parents[i]
        while current is not None and not is_model(derived.nodes[current]):
            if current in copies:
                found.append(i)
                break
            current = derived.parents[current]
    return found


def bridged_state(call: Mapping[str, Any]) -> Any:
    """`True`, `False`, `None`, or the string "absent" when the call has no `bridged` key."""
    return call["bridged"] if "bridged" in call else "absent"


def all_calls(derived: Derived) -> list[Mapping[str, Any]]:
    return [call for node in derived.nodes for call in calls_of(node)]


def sidecar_manifest(document: Mapping[str, Any]) -> Mapping[str, Any]:
    return as_dict(document.get("sidecars"))


def malformed_kinds(document: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(node, kind) pairs where a node slices into a kind the manifest lacks (format.md §3)."""
    manifest = sidecar_manifest(document)
    found = []
    for i, node in enumerate(as_list(document.get("nodes"))):
        if not isinstance(node, dict) or node.get("tokens") is None:
            continue
        tokens = as_dict(node.get("tokens"))
        found += [
            (i, name)
            for name, kind in REGISTRY.items()
            if name not in manifest and kind.slices(tokens)
        ]
    return found


def absent_kinds(document: Mapping[str, Any], present: set[str]) -> list[str]:
    """Listed sidecar kinds to read as absent: omitted, or the file is not in `present`."""
    omitted = {k for k in as_list(document.get("omitted_sidecars")) if isinstance(k, str)}
    absent = []
    for kind, entry in sidecar_manifest(document).items():
        if kind in omitted or as_dict(entry).get("file") not in present:
            absent.append(kind)
    return absent


def text_only_reason(
    document: Mapping[str, Any], derived: Derived, present: set[str]
) -> str | None:
    """Why a token-mode trajectory draws as text (docs/viewer.md "The rollout drawer"), or None when
    it has tokens."""
    if "tokens" in sidecar_manifest(document):
        return "tokens-missing" if "tokens" in absent_kinds(document, present) else None
    return "tokens-unlisted" if uses_tokens(derived) else None


def rollout_flags(document: Mapping[str, Any], derived: Derived, present: set[str]) -> list[str]:
    """The rollout flags of docs/viewer.md "Health band" that hold, in display order.

    `present` holds the file names beside the document (only `tokens-missing` uses it).
    """
    calls = all_calls(derived)
    counts = derived.counts
    bridged_absent = any("bridged" not in call for call in calls)
    holds = {
        "malformed-record": bool(malformed_kinds(document)),
        "tokens-missing": "tokens" in sidecar_manifest(document)
        and "tokens" in absent_kinds(document, present),
        "failed-calls": bool(as_list(document.get("failures"))),
        "incomplete": document.get("ended") is False or document.get("status") == "open",
        "no-logprobs": derived.token_mode and any(c.trainable > c.logprobs for c in counts),
        "unbridged": any(cause is None for cause in unbridged_causes(derived).values()),
        "unbridged-expected": bool(unbridged_causes(derived))
        and all(cause is not None for cause in unbridged_causes(derived).values()),
        "unbridged-inferred": bridged_absent and bool(inferred_unbridged(derived)),
        "replayed": any(
            not is_model(node) and node.get("role") == "assistant" for node in derived.nodes
        ),
        "no-train": derived.token_mode and any(c.trainable == 0 for c in counts),
        "empty": not derived.paths,
        "truncated": any(call.get("finish_reason") == "length" for call in calls),
        "abandoned": document.get("status") == "abandoned",
        "forked": len(derived.paths) > 1,
        "bridged-unknown": bridged_absent,
    }
    return [flag for flag in FLAG_LEVELS if holds.get(flag)]


#: Why a call after a fork or a switch of branch renders its prompt in full (expected).
OTHER_BRANCH = "after a call on another branch"


def unbridged_causes(derived: Derived) -> dict[int, str | None]:
    """Model node with an unbridged call -> why its prompt was rendered in full, or None.

    Bridging extends the previous call's exact tokens, so a call whose history forked since
    the last model node (a resample, a compaction, an edited reply: the fork's cause as
    `skycap check` names it) or whose previous call was on another branch renders in full,
    as expected. None means no such reason: an unexpected re-render worth a look.
    """
    if derived._unbridged is not None:
        return derived._unbridged
    nodes, parents = derived.nodes, derived.parents
    try:
        fork_cause = {f.node: f.cause for f in forks({"nodes": nodes})}
    except (MalformedDocument, KeyError, TypeError, ValueError):
        fork_cause = {}
    order = sorted(
        (call.get("t_start"), i)
        for i, node in enumerate(nodes)
        if is_model(node)
        for call in calls_of(node)
        if isinstance(call.get("t_start"), int | float)
    )
    causes: dict[int, str | None] = {}
    for i, node in enumerate(nodes):
        unbridged = [c for c in calls_of(node) if c.get("bridged") is False]
        if not is_model(node) or not unbridged:
            continue
        cause = None
        current: int | None = i
        while current is not None and cause is None:
            cause = fork_cause.get(current)
            parent = parents[current]
            current = None if parent is None or is_model(nodes[parent]) else parent
        if cause is None:
            start = unbridged[0].get("t_start")
            before = [j for t, j in order if isinstance(start, int | float) and t < start]
            if before and before[-1] not in _ancestors(parents, i):
                cause = OTHER_BRANCH
        causes[i] = cause
    derived._unbridged = causes
    return causes


def _ancestors(parents: list[int | None], node: int) -> set[int]:
    found = set()
    current = parents[node]
    while current is not None:
        found.add(current)
        current = parents[current]
    return found


def health_score(flags: list[str]) -> int:
    """Severity for the health sort: errors outrank warnings outrank infos (quiet flags ignored)."""
    weight = {ERROR: 10_000, WARN: 100, INFO: 1}
    return sum(weight[FLAG_LEVELS[f]] for f in flags if f not in QUIET_FLAGS)


def train_once(document: Mapping[str, Any], derived: Derived) -> dict[str, Any]:
    """The train-once check of docs/viewer.md "The rollout drawer" over all paths.

    Paths train what the record's `samples` rows say when `finish` recorded them (a rule
    other than `all` may leave nodes untrained or, if broken, train one twice); without
    `samples` the paths train their targets, which holds by construction.
    """
    model_nodes = [i for i, node in enumerate(derived.nodes) if is_model(node)]
    trained = dict.fromkeys(model_nodes, 0)
    samples = document.get("samples")
    if isinstance(samples, dict):
        for row in as_list(samples.get("rows")):
            for target in as_list(as_dict(row).get("targets")):
                if is_int(target) and target in trained:
                    trained[target] += 1
    else:
        for node_id in derived.targets:
            trained[node_id] = 1
    twice = [i for i in model_nodes if trained[i] > 1]
    never = [i for i in model_nodes if trained[i] == 0]
    if twice:
        first, *rest = twice
        named = [f"n{first} is trained in {trained[first]} paths"]
        named += [f"n{i} in {trained[i]} paths" for i in rest]
        text = f"Train-once violated: {', '.join(named)}"
    elif never:
        names = ", ".join(f"n{i}" for i in never)
        verb = "is" if len(never) == 1 else "are"
        text = f"Train-once holds, but {names} {verb} trained in no path"
    else:
        text = (
            f"Train-once holds: each of the {len(model_nodes)} model nodes is trained in "
            "exactly one path"
        )
    level = "error" if twice else "warn" if never else "ok"
    return {"ok": not twice, "level": level, "text": text, "twice": twice, "never": never}


def node_signs(derived: Derived) -> dict[int, list[str]]:
    """Tree signs per node (docs/viewer.md "The page"): unbridged, inferred, re-tokenized copy,
    shadowed."""
    signs: dict[int, list[str]] = {}
    copies = retokenized_copies(derived)
    inferred = set(inferred_unbridged(derived))
    causes = unbridged_causes(derived)
    for i, node in enumerate(derived.nodes):
        found = []
        if i in causes:
            found.append("unbridged" if causes[i] is None else f"unbridged ({causes[i]})")
        if i in inferred:
            found.append("unbridged (inferred)")
        if i in copies:
            found.append(f"re-tokenized copy of n{copies[i]}")
        elif is_int(node.get("shadowed_by")):
            found.append(f"shadowed by n{node['shadowed_by']}")
        if found:
            signs[i] = found
    return signs


def _utf16_starts(raw: bytes, starts: np.ndarray) -> tuple[str, np.ndarray]:
    """A node's text and each token's start in UTF-16 code units (what JavaScript indexes).

    Byte offsets map through per-byte unit counts: a 4-byte character is 2 units, other
    lead bytes 1, continuation bytes 0. Text that is not valid UTF-8 is decoded span by span
    with replacement characters instead.
    """
    starts = np.clip(starts.astype(np.int64), 0, len(raw))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        ends = np.append(starts[1:], len(raw))
        pieces = [raw[a:b].decode("utf-8", "replace") for a, b in zip(starts, ends, strict=True)]
        units = np.fromiter((len(p.encode("utf-16-le")) // 2 for p in pieces), np.int64)
        return "".join(pieces), np.concatenate([[0], np.cumsum(units)[:-1]]).astype(np.int64)
    data = np.frombuffer(raw, dtype=np.uint8)
    units = np.ones(data.shape[0], dtype=np.int64)
    units[(data & 0xC0) == 0x80] = 0
    units[data >= 0xF0] = 2
    cumulative = np.concatenate([[0], np.cumsum(units)])
    return text, cumulative[starts]


def token_view(derived: Derived, index: int, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """A path's tokens as compact columns: ids, logprobs (4 places, NaN → null), the path's
    text and each token's start in it (UTF-16 units); a token ends where the next starts."""
    token_ids, logprobs = arrays["token_ids"], arrays["logprobs"]
    text_offsets, text = arrays["text_offsets"], arrays["text"].reshape(-1)
    ids, lps, starts, texts = [], [], [], []
    cursor = 0
    for node_id in derived.paths[index]:
        tokens = node_tokens(derived.nodes[node_id])
        offset = tokens.get("offset") if tokens else None
        if not is_int(offset):
            continue
        end = min(offset + token_length(derived.nodes[node_id]), token_ids.shape[0])
        offset = min(max(offset, 0), end)
        raw = b""
        text_offset, text_bytes = tokens.get("text_offset"), tokens.get("text_bytes")
        if is_int(text_offset) and is_int(text_bytes) and text_offset >= 0:
            raw = text[text_offset : text_offset + text_bytes].tobytes()
        node_text, node_starts = _utf16_starts(raw, text_offsets[offset:end])
        ids.append(token_ids[offset:end])
        lps.append(logprobs[offset:end])
        starts.append(node_starts + cursor)
        texts.append(node_text)
        cursor += len(node_text.encode("utf-16-le")) // 2
    if not ids:
        return {"count": 0, "ids": [], "logprobs": [], "offsets": [], "text": ""}
    joined = np.concatenate(ids)
    return {
        "count": int(joined.shape[0]),
        "ids": joined,
        "logprobs": np.round(np.concatenate(lps).astype(np.float64), 4),
        "offsets": np.concatenate(starts),
        "text": "".join(texts),
    }

"""Fork and cause analysis of a record document: why a trajectory is not linear (graph.md §6).

It reads the document dict only (never sidecars), so `skycap check`, the viewer and the demo
share one explanation of every fork.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skycap.hashing import canonical_json, canonical_message, rendered_fields

RESAMPLE = "resample"
EDITED_REPLY = "edited reply"
RE_RENDERED = "re-rendered"
COMPACTION = "compaction"
DIFFERENT_MESSAGE = "different message"
TOOLS_OR_MODEL = "tools or model"
# Summary order for causes with equal counts: the order graph.md §6 explains them in.
CAUSES = (RESAMPLE, EDITED_REPLY, RE_RENDERED, COMPACTION, DIFFERENT_MESSAGE, TOOLS_OR_MODEL)


class MalformedDocument(ValueError):
    """A readable document whose nodes cannot form a graph (the reason names the node)."""


@dataclass(frozen=True, slots=True)
class Fork:
    """One sibling after the first in its group, explained against its closest earlier sibling."""

    node: int
    parent: int | None
    vs: int
    cause: str
    detail: str

    def line(self) -> str:
        where = "new root" if self.parent is None else f"under node {self.parent}"
        return f"node {self.node} ({where}, vs node {self.vs}): {self.cause}: {self.detail}"


@dataclass(slots=True)
class Linearity:
    """One trajectory's linearity: its path count, forks (by node id) and unbridged calls."""

    id: str
    status: str
    paths: int
    forks: list[Fork] = field(default_factory=list)
    unbridged_calls: int = 0

    @property
    def linear(self) -> bool:
        return self.paths <= 1

    @property
    def shape(self) -> str:
        if self.paths == 0:
            return "empty: no model call captured"  # linear all the same: check exits 0
        return "linear" if self.paths == 1 else f"{self.paths} paths"

    def lines(self) -> list[str]:
        """The report lines of graph.md §6 for this trajectory."""
        out = [f"{self.id}  {self.status}  {self.shape}"]
        out += [f"  {fork.line()}" for fork in self.forks]
        if self.unbridged_calls:
            out.append(
                f"  {self.unbridged_calls} unbridged call(s): prompt re-rendered, not extended"
            )
        return out


@dataclass(frozen=True, slots=True)
class _Node:
    id: int
    parent: int | None
    author: str
    role: str | None
    match_hash: Any
    normalised: dict[str, Any]
    canonical: bytes

    @property
    def is_model(self) -> bool:
        return self.author == "model"


def article(word: str) -> str:
    """`an` before a word starting with a, e, i, o or `un`, else `a`."""
    lower = word.lower()
    return "an" if lower[:1] in ("a", "e", "i", "o") or lower.startswith("un") else "a"


def role_name(role: str | None) -> str:
    return "unnamed" if role is None else role


def _with_article(role: str | None) -> str:
    name = role_name(role)
    return f"{article(name)} {name}"


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Top-level differences from `before` (S) to `after` (N), keys in code-point order."""
    out = []
    for key in sorted(before.keys() | after.keys()):
        if key not in after:
            out.append(f"{key} dropped")
        elif key not in before:
            out.append(f"{key} added")
        elif canonical_json(before[key]) != canonical_json(after[key]):
            out.append(f"{key} changed")
    return out


def checked_nodes(document: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The document's nodes, checked to form a forest a reader can walk without surprises.

    Raises MalformedDocument naming the first node that does not.
    """
    raw = document.get("nodes")
    if not isinstance(raw, list):
        raise MalformedDocument("the document has no nodes array")
    for i, node in enumerate(raw):
        if not isinstance(node, Mapping):
            raise MalformedDocument(f"nodes[{i}] is not an object")
        if node.get("id") != i:
            raise MalformedDocument(f"nodes[{i}].id is {node.get('id')!r}")
        parent = node.get("parent")
        if parent is not None and (
            not isinstance(parent, int) or isinstance(parent, bool) or not 0 <= parent < i
        ):
            raise MalformedDocument(f"node {i} has parent {parent!r}, not an earlier node")
        if node.get("author") not in ("client", "model"):
            raise MalformedDocument(f"node {i}: author {node.get('author')!r}")
        if not isinstance(node.get("message"), Mapping):
            raise MalformedDocument(f"node {i}: message is not an object")
        if not isinstance(node.get("calls", []), list):
            raise MalformedDocument(f"node {i}: calls is not an array")
    return raw


def _nodes(document: Mapping[str, Any]) -> list[_Node]:
    capture = document.get("capture")
    tokens = isinstance(capture, Mapping) and capture.get("mode") == "tokens"
    normalise = rendered_fields if tokens else canonical_message
    nodes = []
    for node in checked_nodes(document):
        role = node.get("role")
        normalised = normalise(node["message"])
        nodes.append(
            _Node(
                id=node["id"],
                parent=node.get("parent"),
                author=node["author"],
                role=role if isinstance(role, str) else None,
                match_hash=node.get("match_hash"),
                normalised=normalised,
                canonical=canonical_json(normalised),
            )
        )
    return nodes


def _closest_earlier_sibling(new: _Node, earlier: Sequence[_Node]) -> _Node:
    """Rules 1-4 of graph.md §6; `earlier` is non-empty and in id order."""
    same_match = [s for s in earlier if s.match_hash == new.match_hash]
    if same_match:
        return max(same_match, key=lambda s: (s.is_model, s.id))
    identical = [s for s in earlier if s.canonical == new.canonical]
    if identical:
        return identical[-1]
    same_role = [s for s in earlier if s.role == new.role]
    if same_role:
        if new.is_model:
            model = [s for s in same_role if s.is_model]
            return (model or same_role)[-1]
        return min(
            same_role,
            key=lambda s: (len(changes(s.normalised, new.normalised)), not s.is_model, -s.id),
        )
    return earlier[-1]


def replaced_run(s: _Node, new: _Node, children: Mapping[int, Sequence[_Node]]) -> list[_Node]:
    """The history `new` took the place of: `s`, then down its newest child made before
    `new` each step, i.e. the messages the other path had reached when `new` forked."""
    run = [s]
    while earlier := [c for c in children.get(run[-1].id, ()) if c.id < new.id]:
        run.append(earlier[-1])
    return run


def compacted(run: Sequence[_Node]) -> bool:
    """Whether one message standing for `run` is a compaction: the other path had sent a
    message after a model reply, so a conversation, not a message, was replaced."""
    return any(node.is_model and i + 1 < len(run) for i, node in enumerate(run))


def _explain(new: _Node, s: _Node, run: Sequence[_Node]) -> tuple[str, str]:
    """(cause, detail) for fork `new` against its closest earlier sibling `s` (graph.md §6);
    `run` is the history from `s` the other path had reached (replaced_run)."""
    same_match = s.match_hash == new.match_hash
    if new.is_model:
        if same_match and s.is_model:
            detail = (
                "the same reply again, under other sampling parameters or tokenized differently"
            )
        elif same_match:
            detail = "the model sampled a message the harness had already written"
        elif s.role == new.role:
            detail = "a second reply to the same history"
        else:
            continued = _with_article(s.role)
            detail = f"a reply to a history the other path continues with {continued} message"
        return RESAMPLE, detail
    if same_match:
        return RE_RENDERED, "the same message, rendered to different tokens"
    if s.canonical == new.canonical:
        return TOOLS_OR_MODEL, "the same message, sent with a different tool set or model"
    if compacted(run) and not (s.is_model and s.role == new.role):
        # One client message where the other path had gone on past a model reply: the
        # history was summarised (graph.md §6), not one message edited in place.
        return COMPACTION, (
            f"{_with_article(new.role)} message in place of the {len(run)} messages from "
            f"node {s.id} to node {run[-1].id}, as a summary replaces the history"
        )
    if s.role != new.role:
        return DIFFERENT_MESSAGE, (
            f"{_with_article(new.role)} message where the other path has "
            f"{_with_article(s.role)} message"
        )
    listed = ", ".join(changes(s.normalised, new.normalised))
    if s.is_model:
        return EDITED_REPLY, f"the harness sent back the model's reply with {listed}"
    return DIFFERENT_MESSAGE, f"a different {role_name(new.role)} message: {listed}"


def forks(document: Mapping[str, Any]) -> list[Fork]:
    """Every fork of the document, sorted by node id."""
    nodes = _nodes(document)
    groups: dict[int | None, list[_Node]] = {}
    for node in nodes:
        groups.setdefault(node.parent, []).append(node)
    children = {parent: group for parent, group in groups.items() if parent is not None}
    found = []
    for parent, siblings in groups.items():
        for k in range(1, len(siblings)):
            new = siblings[k]
            s = _closest_earlier_sibling(new, siblings[:k])
            cause, detail = _explain(new, s, replaced_run(s, new, children))
            found.append(Fork(new.id, parent, s.id, cause, detail))
    found.sort(key=lambda f: f.node)
    return found


def _calls(document: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    for node in document["nodes"]:
        yield from (call for call in node.get("calls", []) if isinstance(call, Mapping))


def analyse(document: Mapping[str, Any]) -> Linearity:
    """Paths, forks and unbridged calls of one readable document.

    Raises MalformedDocument when the nodes do not form a forest.
    """
    found = forks(document)
    nodes = document["nodes"]
    has_children = {n.get("parent") for n in nodes}
    status = document.get("status")
    return Linearity(
        id=str(document.get("id")),
        status=status if isinstance(status, str) else str(status),
        paths=sum(1 for n in nodes if n["id"] not in has_children),
        forks=found,
        unbridged_calls=sum(1 for call in _calls(document) if call.get("bridged") is False),
    )


def summary_line(reports: Sequence[Linearity], unreadable: int) -> str:
    """`<linear> of <readable> trajectories linear[; forks: …][; <n> empty][; <n> unreadable]`.

    Causes are listed most common first; equal counts follow the order of CAUSES.
    """
    linear = sum(1 for r in reports if r.linear)
    line = f"{linear} of {len(reports)} trajectories linear"
    counts = Counter(fork.cause for r in reports for fork in r.forks)
    if counts:
        ordered = sorted(counts, key=lambda c: (-counts[c], CAUSES.index(c)))
        line += "; forks: " + ", ".join(f"{counts[c]} {c}" for c in ordered)
    empty = sum(1 for r in reports if r.paths == 0)
    if empty:
        line += f"; {empty} empty"
    if unreadable:
        line += f"; {unreadable} unreadable"
    return line

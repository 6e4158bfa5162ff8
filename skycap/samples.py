"""Path rules, training rows, per-sample arrays and their finish-wire encoding (graph.md §4, §5)."""

from __future__ import annotations

import importlib
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from skycap.graph import Graph, Tokens
from skycap.record.sidecars import REGISTRY
from skycap.weights import Span, join_spans, read_spans, shift_spans

ALL = "all"
FINAL = "final"
BUILTIN_RULES = (ALL, FINAL)

PathRule = Callable[[Graph], Iterable[tuple[Sequence[int], Sequence[int]]]]


class PathRuleFailed(Exception):
    """A custom rule raised or returned invalid rows; finish answers 500 `path_rule_failed`."""

    def __init__(self, name: str, error: BaseException) -> None:
        super().__init__(f"path rule '{name}' failed: {type(error).__name__}: {error}")
        self.name = name
        self.error = error


class UnknownPathRule(ValueError):
    """A `paths` name no rule answers to (finish answers 400, the trajectory is not ended)."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        super().__init__(f"`paths` must be one of [{', '.join(known)}]")
        self.name = name


class Row(NamedTuple):
    """One training row: a path from a root (root first) and the model nodes it trains.

    A pair, so a custom rule may return (filtered) rows of the built-in rules.
    """

    path: tuple[int, ...]
    targets: tuple[int, ...]

    @property
    def leaf(self) -> int:
        return self.path[-1]


# -- built-in rules --------------------------------------------------------------------------


def rows_all(graph: Graph) -> list[Row]:
    """One row per leaf in leaf-id order; a model node trains in the first row containing it."""
    trained: set[int] = set()
    rows = []
    for path in graph.paths():
        targets = tuple(i for i in path if graph[i].is_model and i not in trained)
        trained.update(targets)
        rows.append(Row(tuple(path), targets))
    return rows


def rows_final(graph: Graph) -> list[Row]:
    """The path to the reply of the call with the latest `t_end`, training every model node on it.

    Ties in `t_end` go to the higher node id (the later node), so the choice is stable.
    """
    latest: tuple[float, int] | None = None
    for node in graph:
        for call in node.calls:
            key = (float(call["t_end"]), node.id)
            if latest is None or key > latest:
                latest = key
    if latest is None:
        return []
    path = graph.path_to(latest[1])
    return [Row(tuple(path), tuple(i for i in path if graph[i].is_model))]


_BUILTINS: dict[str, Callable[[Graph], list[Row]]] = {ALL: rows_all, FINAL: rows_final}


# -- custom rules ----------------------------------------------------------------------------


def resolve_rule(spec: str) -> PathRule:
    """Import `"pkg.module:function"`; errors name the spec and what to fix."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"path rule {spec!r} must be written 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"path rule {spec!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    try:
        rule = operator.attrgetter(attr)(module)
    except AttributeError as exc:
        raise ValueError(f"path rule {spec!r}: module {module_name!r} has no {attr!r}") from exc
    if not callable(rule):
        raise ValueError(f"path rule {spec!r} is a {type(rule).__name__}, not a function")
    return rule


def parse_rule_option(text: str) -> tuple[str, str]:
    """`--path-rule [NAME=]module:function` → (name, import path); split on the last `=`.

    Without `NAME=` the rule is named by its import path (graph.md §4).
    """
    name, sep, spec = text.rpartition("=")
    return (name, spec) if sep else (spec, spec)


def build_rules(path_rules: Mapping[str, PathRule | str] | None) -> dict[str, PathRule]:
    """Resolve configured custom rules once, at start-up; built-in names cannot be reused."""
    rules: dict[str, PathRule] = {}
    for name, rule in (path_rules or {}).items():
        if name in BUILTIN_RULES:
            raise ValueError(f"path rule name {name!r} is built in; choose another name")
        if not name:
            raise ValueError("a path rule needs a non-empty name")
        if isinstance(rule, str):
            rules[name] = resolve_rule(rule)
        elif callable(rule):
            rules[name] = rule
        else:
            raise TypeError(
                f"path rule {name!r} must be a function or 'pkg.module:function', "
                f"got {type(rule).__name__}"
            )
    return rules


def _node_id(value: Any, graph: Graph, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} is a bool, not a node id")
    try:
        node_id = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} is {value!r:.60}, not an integer node id") from None
    if not 0 <= node_id < len(graph):
        raise ValueError(f"{what} is node {node_id}, which does not exist ({len(graph)} nodes)")
    return node_id


def _id_list(value: Any, graph: Graph, what: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a list of node ids, got {type(value).__name__}")
    return tuple(_node_id(v, graph, f"{what}[{k}]") for k, v in enumerate(value))


def validate_rows(graph: Graph, returned: Any) -> list[Row]:
    """Check a custom rule's `(path, targets)` pairs against every rule of graph.md §4."""
    if isinstance(returned, (str, bytes, Mapping)) or not isinstance(returned, Iterable):
        raise TypeError(
            f"the rule returned {type(returned).__name__}, not a list of (path, targets) pairs"
        )
    rows: list[Row] = []
    trained: dict[int, int] = {}
    for r, pair in enumerate(returned):
        if (
            isinstance(pair, (str, bytes, Mapping))
            or not isinstance(pair, Sequence)
            or len(pair) != 2
        ):
            raise TypeError(f"row {r} must be a (path, targets) pair, got {pair!r:.80}")
        path = _id_list(pair[0], graph, f"row {r} path")
        targets = _id_list(pair[1], graph, f"row {r} targets")
        if not path:
            raise ValueError(f"row {r} has an empty path")
        if graph[path[0]].parent is not None:
            raise ValueError(f"row {r} path starts at node {path[0]}, which is not a root")
        for above, below in zip(path, path[1:], strict=False):
            if graph[below].parent != above:
                raise ValueError(f"row {r} path: node {below} is not a child of node {above}")
        on_path = set(path)
        for target in targets:
            if target not in on_path:
                raise ValueError(f"row {r} target {target} is not on its path")
            if not graph[target].is_model:
                raise ValueError(f"row {r} target {target} is a client node, not a model node")
            if trained.get(target) == r:
                raise ValueError(f"row {r} lists target {target} twice")
            if target in trained:
                raise ValueError(
                    f"node {target} is a target in row {trained[target]} and row {r} "
                    "(a node trains in one row at most)"
                )
            trained[target] = r
        rows.append(Row(path, targets))
    return rows


def rows_for_finish(graph: Graph, name: str, rules: Mapping[str, PathRule]) -> list[Row]:
    """The rows of rule `name`: a built-in, or a configured custom rule (validated).

    Raises UnknownPathRule for a name no rule answers to, PathRuleFailed when a custom
    rule raises or returns invalid rows.
    """
    builtin = _BUILTINS.get(name)
    if builtin is not None:
        return builtin(graph)
    rule = rules.get(name)
    if rule is None:
        raise UnknownPathRule(name, [*BUILTIN_RULES, *rules])
    try:
        return validate_rows(graph, rule(graph))
    except Exception as exc:  # a rule is user code: any failure fails the finish, not the server
        raise PathRuleFailed(name, exc) from exc


# -- the recorded form (format.md §4) -------------------------------------------------------


def samples_field(name: str, rows: Sequence[Row]) -> dict[str, Any]:
    """The document's `samples` value for rows a rule produced."""
    return {"paths": name, "rows": [{"leaf": r.leaf, "targets": list(r.targets)} for r in rows]}


def rows_from_samples_field(graph: Graph, recorded: Mapping[str, Any]) -> list[Row]:
    """Rows from a recorded `samples` field: each path is the leaf and its ancestors."""
    entries = recorded.get("rows")
    if not isinstance(entries, list):
        raise ValueError(f"recorded samples: `rows` must be a list, got {entries!r:.60}")
    rows = []
    for r, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"recorded samples row {r} must be an object, got {entry!r:.60}")
        try:
            leaf = _node_id(entry.get("leaf"), graph, f"recorded samples row {r} leaf")
            targets = _id_list(entry.get("targets"), graph, f"recorded samples row {r} targets")
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        rows.append(Row(tuple(graph.path_to(leaf)), targets))
    return rows


# -- per-sample arrays (graph.md §5) --------------------------------------------------------


@dataclass(slots=True, eq=False)
class BuiltSample:
    """One sample with numpy arrays; `input_ids is None` means a text-only sample.

    `sampling_mask` is CSR `(ids int32, offsets int64)` with one row per position.
    `media` is always empty: images are not captured yet. `extra` holds the arrays
    of sidecar kinds registered without a sample field of their own, by sample key.
    """

    leaf: int
    path: list[int]
    messages: list[dict[str, Any]]
    targets: list[int]
    input_ids: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    sampling_mask: tuple[np.ndarray, np.ndarray] | None = None
    media: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[Span] | None = None


def node_weight_versions(node: Any) -> list[Span] | None:
    """The spans over a model node's completion, from the call its tokens came from (the
    first); None when that call has none, or spans that do not fit its completion."""
    tokens = node.tokens
    if not node.calls or tokens is None or tokens.sampled_start is None:
        return None
    try:
        return read_spans(
            node.calls[0].get("weight_versions"), tokens.length - tokens.sampled_start
        )
    except ValueError:
        return None


def sample_weight_versions(
    nodes: Sequence[Any], starts: Sequence[int], targets: set[int]
) -> list[Span] | None:
    """Spans over a sample's own positions: each trained node's completion spans, shifted to
    where its sampled tokens sit (context positions carry none); None when no trained node
    reported any."""
    spans: list[Span] = []
    reported = False
    for node, start in zip(nodes, starts, strict=False):
        if node.id not in targets:
            continue
        found = node_weight_versions(node)
        if found is None:
            continue
        reported = True
        spans += shift_spans(found, start + node.tokens.sampled_start)
    return join_spans(spans) if reported else None


def build_sample(graph: Graph, path: Sequence[int], targets: Sequence[int]) -> BuiltSample:
    """The sample of one row; token arrays only when every node on the path has tokens."""
    nodes = [graph[i] for i in path]
    sample = BuiltSample(
        leaf=path[-1],
        path=list(path),
        messages=[n.message for n in nodes],
        targets=list(targets),
    )
    if any(n.tokens is None for n in nodes):
        return sample
    tokens: list[Tokens] = [n.tokens for n in nodes]  # type: ignore[misc]
    lengths = np.fromiter((t.length for t in tokens), dtype=np.int64, count=len(tokens))
    starts = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    total = int(starts[-1])
    target_set = set(targets)

    sample.input_ids = np.concatenate([t.ids for t in tokens]).astype(np.int32, copy=False)
    sample.loss_mask = np.zeros(total, dtype=np.int8)
    sample.logprobs = np.zeros(total, dtype=np.float64)
    for node, tok, start in zip(nodes, tokens, starts.tolist(), strict=False):
        end = start + tok.length
        if tok.logprobs is not None:
            sample.logprobs[start:end] = tok.logprobs
        if node.id in target_set and tok.sampled_start is not None:
            sample.loss_mask[start + tok.sampled_start : end] = 1
    # NaN marks "no logprob" in records; samples carry 0.0 there (and never a non-finite value,
    # which JSON cannot carry). A sampled token the engine gave no logprob (vLLM's -9999.0
    # sentinel) is not trained on: its loss mask is 0, so no importance ratio uses it.
    missing = ~np.isfinite(sample.logprobs)
    sample.loss_mask[missing] = 0
    sample.logprobs[missing] = 0.0
    for kind in REGISTRY.values():
        if kind.sample_key is None:
            continue
        value = kind.sample(nodes, tokens, starts, target_set, sample.loss_mask)
        if kind.own:
            setattr(sample, kind.sample_key, value)
        elif value is not None:
            sample.extra[kind.sample_key] = value
    sample.weight_versions = sample_weight_versions(nodes, starts.tolist(), target_set)
    return sample


def build_samples(graph: Graph, rows: Sequence[Row]) -> list[BuiltSample]:
    return [build_sample(graph, row.path, row.targets) for row in rows]


def encode_sample(sample: BuiltSample) -> dict[str, Any]:
    """The finish-wire object (graph.md §5); text-only samples carry only the first four keys."""
    out: dict[str, Any] = {
        "leaf": sample.leaf,
        "path": list(sample.path),
        "messages": sample.messages,
        "targets": list(sample.targets),
    }
    if sample.input_ids is None:
        return out
    out["input_ids"] = sample.input_ids.tolist()
    out["loss_mask"] = sample.loss_mask.tolist()
    out["logprobs"] = sample.logprobs.tolist()
    for kind in REGISTRY.values():
        key = kind.sample_key
        if key is None:
            continue
        if kind.own:
            out[key] = kind.encode(getattr(sample, key))
        elif key in sample.extra:
            out[key] = kind.encode(sample.extra[key])
    if sample.weight_versions is not None:
        out["weight_versions"] = sample.weight_versions
    out["media"] = []
    return out

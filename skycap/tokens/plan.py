"""The token-mode turn plan: match, respellings, bridge, full render, attribution
(docs/architecture.md "Token mode").

A plan is computed on a renderer worker thread, never on the event loop, while the
trajectory's turn lock is held (so the graph does not change under it). It reads the graph
and may register respelling aliases; nodes are only added by the commit
(skycap.tokens.commit) once the engine has answered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from skycap.graph import Graph, Node
from skycap.hashing import loose_fields, token_match
from skycap.tokens.renderer import Rendered, Renderer, RenderError, starts_with


class PlanError(ValueError):
    """The request cannot become attributed tokens: HTTP 400 before inference
    (docs/tokens.md "Outcomes the harness sees")."""


@dataclass(slots=True)
class NewMessage:
    """A request message the commit adds as a client node, with its token chunk."""

    message: dict[str, Any]
    match_hash: str
    ids: np.ndarray


@dataclass(slots=True)
class Plan:
    """What the engine is sent and how the commit attributes it.

    `prompt_ids` is the whole prompt: `reused` tokens already in the graph on the path to
    `parent`, then each new message's chunk, then `scaffold` (the generation prompt, which
    becomes the model node's scaffold). `bridged` is recorded on the call (None: the graph
    was empty when the turn was planned). `shared`: `prompt_ids` are the shared int objects
    (a render cache hit's), so the lists kept for the next turn can be this very list.
    """

    prompt_ids: list[int]
    parent: int | None
    new: list[NewMessage]
    scaffold: np.ndarray
    bridged: bool | None
    reused: int
    routes_from: int
    shared: bool = False


@dataclass(frozen=True, slots=True)
class TurnLists:
    """A committed model node's path tokens as Python lists, kept for the next turn's bridge.

    Converting 100k+ token ids from node arrays to Python ints is a measurable share of a
    turn. A node's tokens and its path never change once added, so lists recorded
    for `node` of `graph` stay exact for as long as that graph lives.
    """

    graph: Graph
    node: int
    prompt_ids: list[int]
    completion_ids: list[int]


def plan_turn(
    graph: Graph,
    renderer: Renderer,
    messages: list[dict[str, Any]],
    tools: list[Any] | None,
    tools_key: str,
    model: str,
    previous: TurnLists | None = None,
) -> Plan:
    """Plan one turn for `messages` (docs/architecture.md "Token mode"); PlanError on a plan error.

    `previous` (the lists of an earlier turn's model node) spares rebuilding them when the
    bridge extends that same node; it is ignored for any other node or graph.
    """
    if not messages:
        raise PlanError("`messages` is empty: a turn needs at least one message to render")
    tools = tools or None
    hashes = [token_match(m, tools_key, model) for m in messages]
    matched = _match(graph, renderer, messages, hashes, tools, tools_key, model)
    carried = [graph[node_id].match_hash for node_id in matched] + hashes[len(matched) :]
    plan = _bridge(graph, renderer, messages, carried, matched, tools, previous)
    if plan is None:
        plan = _full_render(graph, renderer, messages, carried, matched, tools)
    return plan


# -- match ----------------------------------------------------------------------------------


def _match(
    graph: Graph,
    renderer: Renderer,
    messages: list[dict[str, Any]],
    hashes: list[str],
    tools: list[Any] | None,
    tools_key: str,
    model: str,
) -> list[int]:
    """Node ids of the matched prefix; respellings are tried only at a miss."""
    matched = graph.walk(hashes)
    request_ids: list[int] | None = None
    while len(matched) < len(messages):
        index = len(matched)
        parent = matched[-1] if matched else None
        candidates = _respelling_candidates(graph, parent, messages[index], tools_key, model)
        if not candidates:
            break
        if request_ids is None:
            request_ids = list(_render(renderer, messages, tools).token_ids)
        found = next(
            (
                c
                for c in candidates
                if _renders_as(renderer, messages, index, graph[c].message, tools, request_ids)
            ),
            None,
        )
        if found is None:
            break
        graph.aliases.setdefault((parent, hashes[index]), found)
        matched = [*matched, found, *graph.walk(hashes[index + 1 :], start=found)]
    return matched


def _respelling_candidates(
    graph: Graph, parent: int | None, message: dict[str, Any], tools_key: str, model: str
) -> list[int]:
    """Children of `parent` that differ from `message` at most in empty strings, one per match hash.

    A child counts only if its stored match hash is the token match of its own message
    under this call's tools and model; per hash, model-authored wins, then the newest.
    """
    loose = loose_fields(message)
    best: dict[str, Node] = {}
    for child_id in graph.children(parent):
        child = graph[child_id]
        if loose_fields(child.message) != loose:
            continue
        if token_match(child.message, tools_key, model) != child.match_hash:
            continue
        held = best.get(child.match_hash)
        if held is None or (child.is_model, child.id) > (held.is_model, held.id):
            best[child.match_hash] = child
    return [node.id for node in best.values()]


def _renders_as(
    renderer: Renderer,
    messages: list[dict[str, Any]],
    index: int,
    substitute: dict[str, Any],
    tools: list[Any] | None,
    request_ids: list[int],
) -> bool:
    respelled = [*messages[:index], substitute, *messages[index + 1 :]]
    try:
        return renderer.render(respelled, tools).token_ids == request_ids
    except RenderError:
        return False


def _render(
    renderer: Renderer, messages: list[dict[str, Any]], tools: list[Any] | None
) -> Rendered:
    try:
        return renderer.render(messages, tools)
    except RenderError as exc:
        raise PlanError(str(exc)) from exc


# -- bridge ---------------------------------------------------------------------------------


def _bridge(
    graph: Graph,
    renderer: Renderer,
    messages: list[dict[str, Any]],
    carried: list[str],
    matched: list[int],
    tools: list[Any] | None,
    previous: TurnLists | None,
) -> Plan | None:
    """Extend the deepest matched model call's exact tokens, or None to render in full."""
    at = _deepest_sampled(graph, matched)
    if at is None or at == len(messages) - 1:
        return None
    path = [graph[node_id] for node_id in matched[: at + 1]]
    prompt, completion = _path_lists(graph, path, previous)
    new_messages = messages[at + 1 :]
    try:
        result = renderer.bridge(prompt, completion, new_messages, tools)
    except RenderError:
        return None
    reused = len(prompt) + len(completion)
    if (
        result is None
        or result.reused != reused
        or not starts_with(result.token_ids, prompt, completion)
    ):
        return None
    tail = np.asarray(result.token_ids[reused:], dtype=np.int32)
    chunks, scaffold = attribute(tail, result.message_indices, len(new_messages))
    if _unrendered(new_messages, chunks) is not None:
        return None  # the full render decides, and refuses if it drops the message too
    return _plan(
        result.token_ids, path, messages, carried, chunks, scaffold, bridged=True, reused=reused
    )


def _path_lists(
    graph: Graph, path: list[Node], previous: TurnLists | None
) -> tuple[list[int], list[int]]:
    """(prompt, completion) of the model node ending `path`; `previous` if recorded for it."""
    model = path[-1]
    if previous is not None and previous.graph is graph and previous.node == model.id:
        return previous.prompt_ids, previous.completion_ids
    tokens = model.tokens
    prompt = np.concatenate(
        [node.tokens.ids for node in path[:-1]] + [tokens.ids[: tokens.sampled_start]]
    ).tolist()
    return prompt, tokens.ids[tokens.sampled_start :].tolist()


def _deepest_sampled(graph: Graph, matched: list[int]) -> int | None:
    """Index in `matched` of the deepest model node with tokens and a sampled_start."""
    for index in range(len(matched) - 1, -1, -1):
        node = graph[matched[index]]
        if node.is_model and node.tokens is not None and node.tokens.sampled_start is not None:
            return index
    return None


# -- full render ----------------------------------------------------------------------------


def _full_render(
    graph: Graph,
    renderer: Renderer,
    messages: list[dict[str, Any]],
    carried: list[str],
    matched: list[int],
    tools: list[Any] | None,
) -> Plan:
    """Render everything; keep the matched nodes whose tokens the render reproduces exactly."""
    result = _render(renderer, messages, tools)
    ids, indices = _arrays(result)
    owner = _owners(ids, indices, len(messages))
    kept, reused = _kept_prefix(graph, matched, ids, owner)
    tail_owner = owner[reused:] - kept
    # Tokens after a kept model node that the template adds to its message (the separator
    # after the stop token, or a close synthesised after a truncated reply) are scaffold of
    # the first new message, as in a bridge.
    np.maximum(tail_owner, 0, out=tail_owner)
    chunks, scaffold = _split(ids[reused:], tail_owner, len(messages) - kept)
    path = [graph[node_id] for node_id in matched[:kept]]
    bridged = False if len(graph) else None
    plan = _plan(
        result.token_ids, path, messages, carried, chunks, scaffold, bridged=bridged, reused=reused
    )
    plan.shared = result.shared
    return plan


def _arrays(result: Rendered) -> tuple[np.ndarray, Sequence[int]]:
    """(token ids as an int32 array, message indices) of a full render.

    A render cache hit carries both as arrays already; converting its lists again would be
    most of what the hit costs.
    """
    if result.arrays is not None:
        return result.arrays
    return np.asarray(result.token_ids, dtype=np.int32), result.message_indices


def _kept_prefix(
    graph: Graph, matched: list[int], ids: np.ndarray, owner: np.ndarray
) -> tuple[int, int]:
    """(number of matched nodes kept, tokens they cover) for a full render.

    A node is kept while its tokens equal the render's at the running offset and hold no
    token of a later message. A client node must also end on its message's boundary; a
    model node is kept when scaffold + completion (stop token included) match exactly.
    """
    offset = 0
    total = int(ids.shape[0])
    for index, node_id in enumerate(matched):
        node = graph[node_id]
        tokens = node.tokens
        if tokens is None or tokens.media:
            return index, offset
        end = offset + tokens.length
        if end > total or not np.array_equal(ids[offset:end], tokens.ids):
            return index, offset
        if end > offset and owner[end - 1] > index:
            return index, offset
        if not node.is_model and end < total and owner[end] <= index:
            return index, offset
        offset = end
    return len(matched), offset


# -- attribution ----------------------------------------------------------------------------


def attribute(
    ids: np.ndarray, indices: Sequence[int], count: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """Split `ids` into one chunk per message (scaffold goes to the following message) and the
    trailing generation prompt; PlanError on indices that cannot be attributed."""
    return _split(ids, _owners(ids, indices, count), count)


def _owners(ids: np.ndarray, indices: Sequence[int], count: int) -> np.ndarray:
    """Per token, the message it belongs to; `count` for the trailing generation prompt."""
    if len(indices) != ids.shape[0]:
        raise PlanError(
            f"renderer returned {ids.shape[0]} token ids but {len(indices)} message indices; "
            "each token needs exactly one"
        )
    index = np.asarray(indices, dtype=np.int64)
    if index.size and index.min() < -1:
        raise PlanError(
            f"renderer attributed a token to message {int(index.min())}; indices must be "
            "-1 (scaffold) or a message position"
        )
    real = index[index >= 0]
    if real.size and real.max() >= count:
        raise PlanError(f"renderer attributed a token to message {int(real.max())} of {count}")
    steps = np.flatnonzero(np.diff(real) < 0)
    if steps.size:
        at = int(steps[0])
        raise PlanError(
            f"renderer attributions are not in message order: message {int(real[at + 1])} "
            f"after message {int(real[at])}"
        )
    filled = np.where(index < 0, count, index)
    return np.minimum.accumulate(filled[::-1])[::-1]


def _split(ids: np.ndarray, owner: np.ndarray, count: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Chunks are copies: a node must not keep a whole rendered prompt alive through a view."""
    bounds = np.searchsorted(owner, np.arange(count + 1), side="left").tolist()
    chunks = [ids[bounds[i] : bounds[i + 1]].copy() for i in range(count)]
    return chunks, ids[bounds[count] :].copy()


def _plan(
    prompt_ids: list[int],
    path: list[Node],
    messages: list[dict[str, Any]],
    carried: list[str],
    chunks: list[np.ndarray],
    scaffold: np.ndarray,
    *,
    bridged: bool | None,
    reused: int,
) -> Plan:
    """The plan keeping `path` (its `reused` tokens) and adding messages[len(path):] as `chunks`.

    PlanError when a new message with content got no tokens: the template dropped it, so
    the engine would never see it while its node would claim it was part of the prompt.
    """
    kept = len(path)
    dropped = _unrendered(messages[kept:], chunks)
    if dropped is not None:
        message = messages[kept + dropped]
        raise PlanError(
            f"message {kept + dropped} (role {message.get('role')!r}) renders to no tokens "
            "with this chat template, so the model would never see it; send it with a role "
            "the template renders, such as 'system'"
        )
    new = zip(messages[kept:], carried[kept:], chunks, strict=True)
    return Plan(
        prompt_ids=prompt_ids,
        parent=path[-1].id if path else None,
        new=[NewMessage(message, match, ids) for message, match, ids in new],
        scaffold=scaffold,
        bridged=bridged,
        reused=reused,
        routes_from=_routes_from(path, reused),
    )


def _unrendered(messages: Sequence[Mapping[str, Any]], chunks: list[np.ndarray]) -> int | None:
    """Position of the first message that carries content but got an empty chunk, if any.

    A message with nothing to render (empty content, no tool calls, no reasoning) may
    have an empty chunk (docs/architecture.md "Token mode").
    """
    for position, (message, chunk) in enumerate(zip(messages, chunks, strict=True)):
        if chunk.shape[0] == 0 and _carries_content(message):
            return position
    return None


def _carries_content(message: Mapping[str, Any]) -> bool:
    """Whether a message holds anything the model could be shown."""
    content = message.get("content")
    if isinstance(content, list):
        has_content = any(_part_has_content(part) for part in content)
    else:
        has_content = isinstance(content, str) and content != ""
    reasoning = message.get("reasoning_content")
    return (
        has_content
        or bool(message.get("tool_calls"))
        or (isinstance(reasoning, str) and reasoning != "")
    )


def _part_has_content(part: Any) -> bool:
    """A non-empty text part, or any media part (an image is content too)."""
    if not isinstance(part, Mapping):
        return False
    if part.get("type", "text") != "text":
        return True
    text = part.get("text")
    return isinstance(text, str) and text != ""


def _routes_from(path: list[Node], reused: int) -> int:
    """First position whose routed experts the engine must return
    (docs/architecture.md "Token mode").

    0 (everything) unless every node on the path holds a complete set of rows; then the
    prefix's final position, so its placeholder row is replaced by the real one.
    """
    if not path or reused == 0:
        return 0
    for node in path:
        tokens = node.tokens
        if tokens is None or tokens.experts is None or tokens.experts.shape[0] != tokens.length:
            return 0
    return reused - 1

"""The text-mode commit: place one call's messages and reply in the graph (graph.md §1)."""

from __future__ import annotations

from typing import Any

from skycap.dialects import Request
from skycap.graph import CLIENT, MODEL, Node
from skycap.hashing import Remembered, model_key, text_model_delta
from skycap.trajectory import Trajectory


def commit_text_call(
    trajectory: Trajectory,
    request: Request,
    reply: dict[str, Any],
    call: dict[str, Any],
    remembered: Remembered | None = None,
) -> Node | None:
    """Commit the request's messages and the reply; return the model node, or None if sealed.

    `request` is the call read by its dialect (canonical messages and tools); `reply` is
    the canonical reply message; `call` is the call record without `tools` and `bridged`,
    which are filled in here. `remembered` are the trajectory's hashes so far (the server
    keeps them per open trajectory), else nothing is remembered.
    """
    hashes = Remembered() if remembered is None else remembered
    if not trajectory.is_open:
        return None
    graph = trajectory.graph
    tools_key = trajectory.register_tools(request.tools, hashes.tools_hash(request.tools))
    model = model_key(request.model)
    key = tools_key or ""
    messages = request.messages
    matches = [hashes.text_match(m, key, model) for m in messages]
    matched = graph.walk(matches)
    parent = matched[-1] if matched else None
    t_start = call["t_start"]
    for message, match in zip(messages[len(matched) :], matches[len(matched) :], strict=True):
        parent = graph.add(
            parent,
            author=CLIENT,
            message=message,
            match_hash=match,
            delta_hash=match,
            created_at=t_start,
        ).id
    match = hashes.text_match(reply, key, model)
    node = graph.add(
        parent,
        author=MODEL,
        message=reply,
        match_hash=match,
        delta_hash=text_model_delta(match, call["sampling"]),
        created_at=call["t_end"],
    )
    node.calls.append({**call, "tools": tools_key, "bridged": None})
    return node

"""Responses statefulness on the server: where a `previous_response_id` call goes.

Every Responses call records its reply's id (`response_id`) on its model node, so a later
call naming it as `previous_response_id` continues from that node: its history is the
path to the node (without that call's own `instructions`, which the API does not carry
over), and it hashes, renders and bridges exactly as if the client had sent the whole
history with `store: false`. Token mode must find the id (404 otherwise, as vLLM and
OpenAI answer); text mode forwards the id to its upstream, which resolves it, and a
response this trajectory never saw leaves the call placed by its own input alone.
"""

from __future__ import annotations

from typing import Any

from skycap.dialects import Request
from skycap.dialects.responses_read import check_tool_results, with_history
from skycap.graph import MODEL, Graph
from skycap.trajectory import Trajectory

KEY = "response_id"


class UnknownResponse(LookupError):
    """A `previous_response_id` this trajectory did not answer (a 404 naming the param)."""


def recorded_reply(graph: Graph, response_id: str) -> tuple[int, dict[str, Any]] | None:
    """(model node id, call) of the reply recorded as `response_id`, newest first."""
    for node in reversed(graph.nodes):
        if node.author == MODEL:
            for call in node.calls:
                if call.get(KEY) == response_id:
                    return node.id, call
    return None


def history_of(graph: Graph, node_id: int, call: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages on the path to `node_id`, reply included, its call's instructions not."""
    messages = [graph[i].message for i in graph.path_to(node_id)]
    return messages[1:] if call.get("instructions") else messages


def place(trajectory: Trajectory, request: Request, *, token_mode: bool) -> None:
    """Put the named response's history into `request.messages`, then check tool results.

    Token mode renders `developer` messages as `system` ones (chat templates such as
    Qwen3's have no developer role and would drop them; the Responses API means both as
    instructions), stores them so, and records `developer_as_system` on the call.
    Raises UnknownResponse (token mode: the id must be this trajectory's) or BodyError (a
    `function_call_output` answering no call in the whole history).
    """
    if token_mode and any(m.get("role") == "developer" for m in request.messages):
        request.messages = [
            {**m, "role": "system"} if m.get("role") == "developer" else m for m in request.messages
        ]
        request.recorded["developer_as_system"] = True
    must_resolve = token_mode
    previous = request.extras.get("previous_response_id")
    if previous is not None:
        found = recorded_reply(trajectory.graph, previous)
        if found is None:
            if must_resolve:
                raise UnknownResponse(
                    f"Previous response with id '{previous}' not found in trajectory "
                    f"{trajectory.id}: previous_response_id must name a response answered "
                    "in the same trajectory"
                )
            return  # text mode: the upstream holds a history skycap never saw
        request.messages = with_history(request, history_of(trajectory.graph, *found))
    check_tool_results(request.messages)

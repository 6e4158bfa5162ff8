"""Re-render a token-mode record's calls and compare with the prompts it holds, so a user
learns when the trainer's tokenizer or chat template drifted from the capture's
(docs/tokens.md "Reproducing a record's prompts").

Each call is re-rendered as token mode planned it: a bridged call extends the recorded
tokens of the model call before it with the new messages, any other renders its messages
whole. Only the renderer's own output is compared, so a call differs exactly when the
named tokenizer and template would have sent the engine another prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from skycap.graph import Node
from skycap.tokens.provenance import renderer_provenance
from skycap.tokens.renderer import Renderer, RenderError
from skycap.trajectory import Trajectory


@dataclass(frozen=True)
class CallCheck:
    """One call: its model node, how many prompt tokens it had and got, and where they part."""

    node: int
    recorded: int
    rendered: int
    differs_at: int | None
    error: str | None = None

    @property
    def matches(self) -> bool:
        return self.differs_at is None and self.error is None

    def describe(self) -> str:
        if self.error is not None:
            return f"call at node {self.node}: cannot re-render: {self.error}"
        if self.differs_at is None:
            return f"call at node {self.node}: {self.recorded} prompt tokens match"
        return (
            f"call at node {self.node}: prompt differs from token {self.differs_at} "
            f"(recorded {self.recorded} tokens, re-rendered {self.rendered})"
        )


def digest_drift(trajectory: Trajectory, renderer: Renderer) -> list[str]:
    """The provenance fields in which the record and `renderer` already disagree."""
    recorded = trajectory.provenance or {}
    mine = renderer_provenance(renderer)
    drift = []
    digest = (recorded.get("tokenizer") or {}).get("digest")
    if digest and digest != mine["tokenizer"].get("digest"):
        drift.append("tokenizer digest")
    template = recorded.get("chat_template_digest")
    if template and template != mine.get("chat_template_digest"):
        drift.append("chat template digest")
    if recorded.get("renderer") and recorded.get("renderer") != mine.get("renderer"):
        drift.append(f"renderer ({recorded['renderer']} vs {mine.get('renderer')})")
    return drift


def reproduce(trajectory: Trajectory, renderer: Renderer) -> list[CallCheck]:
    """Each model call with tokens, in node order, re-rendered and compared."""
    graph = trajectory.graph
    checks = []
    for node in graph:
        tokens = node.tokens
        if not node.is_model or tokens is None or tokens.sampled_start is None or not node.calls:
            continue
        path = [graph[i] for i in graph.path_to(node.id)[:-1]]
        if any(n.tokens is None for n in path):
            continue
        recorded = _ids(path) + tokens.ids[: tokens.sampled_start].tolist()
        call = node.calls[0]
        tools = trajectory.tools.get(call.get("tools") or "")
        try:
            rendered = _render(renderer, path, tools, bridged=call.get("bridged") is True)
        except RenderError as exc:
            checks.append(CallCheck(node.id, len(recorded), 0, None, str(exc)))
            continue
        checks.append(
            CallCheck(node.id, len(recorded), len(rendered), _parting(recorded, rendered))
        )
    return checks


def _render(
    renderer: Renderer, path: list[Node], tools: list[Any] | None, *, bridged: bool
) -> list[int]:
    """The prompt token mode would send for a call after `path` (root first)."""
    messages = [n.message for n in path]
    at = next((i for i in range(len(path) - 1, -1, -1) if path[i].is_model), None)
    if bridged and at is not None and at < len(path) - 1:
        model = path[at].tokens
        assert model is not None and model.sampled_start is not None
        prompt = _ids(path[:at]) + model.ids[: model.sampled_start].tolist()
        completion = model.ids[model.sampled_start :].tolist()
        result = renderer.bridge(prompt, completion, messages[at + 1 :], tools or None)
        if result is not None:
            return list(result.token_ids)
    return list(renderer.render(messages, tools or None).token_ids)


def _ids(path: list[Node]) -> list[int]:
    if not path:
        return []
    return np.concatenate([n.tokens.ids for n in path]).tolist()  # type: ignore[union-attr]


def _parting(recorded: list[int], rendered: list[int]) -> int | None:
    """The first position where the two differ (the shorter's length if one extends the
    other), or None when equal."""
    for position, (a, b) in enumerate(zip(recorded, rendered, strict=False)):
        if a != b:
            return position
    return None if len(recorded) == len(rendered) else min(len(recorded), len(rendered))

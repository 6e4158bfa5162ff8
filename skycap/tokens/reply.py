"""Token-mode reply messages: the renderer's parse of a completion, stored and answered
(http.md §3.2).

The wire forms of the answer (JSON, SSE) are the dialect's (skycap.dialects); this module
only turns completion tokens into the canonical message and its finish reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from skycap.tokens.renderer import Renderer, parse_reply, raw_content


def reply_message(
    renderer: Renderer,
    completion_ids: Sequence[int],
    tools: list[Any] | None,
    prompt_ids: Sequence[int],
    *,
    use_raw_content: bool,
    skip_special_tokens: bool = True,
) -> dict[str, Any]:
    """The canonical reply message stored on the model node.

    Raw content (`--use-raw-content`) stores only role and content, so a harness that
    replays `content` verbatim stays on one path. Runs on a renderer worker thread.
    """
    if use_raw_content:
        content = raw_content(
            renderer, completion_ids, prompt_ids, skip_special_tokens=skip_special_tokens
        )
        return {"role": "assistant", "content": content}
    return parse_reply(renderer, completion_ids, tools, prompt_ids)


def answered_message(
    stored: dict[str, Any], *, use_raw_content: bool, reasoning_field: str = "both"
) -> dict[str, Any]:
    """The message answered to the harness for `stored`.

    vLLM answers the reasoning text as `reasoning_content` (older) or `reasoning` (newer);
    harnesses read one or the other, so by default both are sent, and a replay of either
    folds back to the stored `reasoning_content`. Raw content answers
    `reasoning_content: null` (and `reasoning: null`) so a client keeps no reasoning.
    """
    answered = dict(stored)
    if use_raw_content:
        answered["reasoning_content"] = None
    if "reasoning_content" not in answered or reasoning_field == "reasoning_content":
        return answered
    answered["reasoning"] = answered["reasoning_content"]
    if reasoning_field == "reasoning":
        del answered["reasoning_content"]
    return answered


def finish_reason(engine_reason: str, message: dict[str, Any]) -> str:
    """The engine's reason, except `stop` becomes `tool_calls` when the reply calls tools."""
    if engine_reason == "stop" and message.get("tool_calls"):
        return "tool_calls"
    return engine_reason

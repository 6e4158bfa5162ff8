"""Tool-using agents on the unchanged openai SDK, for the rollout loop and compose tests.

`episode` is a real agent loop: it calls the model with a tool, runs each tool call it gets
back, sends the results, and stops at a reply without tool calls (the scripted engine's
default episode calls the tool twice, then answers). `hooks` let a test fork, fail or stall
the episode at a given call.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from openai import AsyncOpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a careful agent. Use the tools."}
MAX_TURNS = 6

#: Called before call number `n` (from 0) with the history about to be sent; may edit it.
Hook = Callable[[int, list[dict[str, Any]]], Awaitable[None] | None]


def openai_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """The trainer's sampling parameters as SDK keywords (top_k is not an OpenAI field)."""
    params = {k: v for k, v in sampling.items() if k != "top_k"}
    if "top_k" in sampling:
        params["extra_body"] = {"top_k": sampling["top_k"]}
    return params


def replayed(message: Any) -> dict[str, Any]:
    """The assistant message as the SDK returned it, to send back unchanged."""
    return message.model_dump(exclude_none=True)


async def episode(
    client: AsyncOpenAI,
    task: str | list[dict[str, Any]],
    sampling: dict[str, Any],
    *,
    hook: Hook | None = None,
    max_turns: int = MAX_TURNS,
) -> tuple[str, int]:
    """Run the agent on `task` (or go on from a history); (the final answer, calls made)."""
    messages = [SYSTEM, {"role": "user", "content": task}] if isinstance(task, str) else task
    for call in range(max_turns):
        if hook is not None:
            pending = hook(call, messages)
            if pending is not None:
                await pending
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, **openai_sampling(sampling)
        )
        message = reply.choices[0].message
        messages.append(replayed(message))
        if not message.tool_calls:
            return message.content or "", call + 1
        for tool_call in message.tool_calls:
            query = json.loads(tool_call.function.arguments or "{}").get("query", "")
            messages.append(
                {"role": "tool", "tool_call_id": tool_call.id, "content": f"notes on {query}"}
            )
    return "", max_turns


def client_for(base_url: str, api_key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)

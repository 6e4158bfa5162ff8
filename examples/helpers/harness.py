"""The agent harness the capture examples run: an ordinary tool-using loop on the openai SDK.

Nothing here knows about skycap. The harness gets a base URL and an API key (or, behind
HTTPS_PROXY, nothing at all) exactly as it would for any OpenAI-compatible server.
"""

from __future__ import annotations

import json

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the project notes.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]
MAX_TURNS = 6


def run_harness(client: openai.OpenAI, task: str) -> str:
    """Call the model until it stops calling tools; return its final answer."""
    messages: list[dict] = [
        {"role": "system", "content": "You are a careful research agent. Use tools."},
        {"role": "user", "content": task},
    ]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, temperature=0.7
        )
        message = reply.choices[0].message
        # Send the reply back exactly as received, so the next call extends this one.
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            query = json.loads(call.function.arguments or "{}").get("query", "")
            result = f"The notes mention {query!r} {len(query)} times."
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def score(answer: str) -> float:
    """The reward: 1 for a finished answer, else 0."""
    return 1.0 if answer.startswith("Done") else 0.0

"""The body Codex CLI 0.169.0 sends at its defaults (captured 2026-12-05, descriptions cut).

Its tools arrive in an `additional_tools` input item as `namespace` tools holding a
`custom` tool with a lark grammar and function tools; the body adds `client_metadata`,
`reasoning.context`, `text.verbosity` and `prompt_cache_key` (notes: clients.md).
"""

from __future__ import annotations

import copy
from typing import Any

import openai

EXEC_GRAMMAR = (
    "\nstart: pragma_source | plain_source\npragma_source: PRAGMA_LINE NEWLINE SOURCE\n"
    "plain_source: SOURCE\n\nPRAGMA_LINE: /[ \\t]*\\/\\/ @exec:[^\\r\\n]*/\n"
    "NEWLINE: /\\r?\\n/\nSOURCE: /[\\s\\S]+/\n"
)
ADDITIONAL_TOOLS: dict[str, Any] = {
    "type": "additional_tools",
    "id": "at_01a244aa-2fb1-71b1-91c8-2d76f469063f",
    "role": "developer",
    "tools": [
        {
            "type": "namespace",
            "name": "functions",
            "description": "",
            "tools": [
                {
                    "type": "custom",
                    "name": "exec",
                    "description": "Run JavaScript code to orchestrate/compose tool calls",
                    "format": {"type": "grammar", "syntax": "lark", "definition": EXEC_GRAMMAR},
                },
                {
                    "type": "function",
                    "name": "wait",
                    "description": "Waits on a yielded `exec` cell.",
                    "strict": False,
                    "parameters": {
                        "type": "object",
                        "properties": {"cell_id": {"type": "string"}},
                        "required": ["cell_id"],
                        "additionalProperties": False,
                    },
                },
            ],
        },
        {
            "type": "namespace",
            "name": "clock",
            "description": "Tools for reading and waiting on time.",
            "tools": [
                {
                    "type": "function",
                    "name": "sleep",
                    "description": "Pause execution for a specified duration.",
                    "strict": False,
                    "parameters": {
                        "type": "object",
                        "properties": {"duration_ms": {"type": "number"}},
                        "required": ["duration_ms"],
                        "additionalProperties": False,
                    },
                }
            ],
        },
        {
            "type": "namespace",
            "name": "collaboration",
            "description": "Tools for spawning and managing sub-agents.",
            "tools": [
                {
                    "type": "function",
                    "name": "spawn_agent",
                    "description": "Spawn a sub-agent.",
                    "strict": False,
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "message": {"type": "string", "encrypted": True},
                            "task_name": {"type": "string"},
                        },
                        "required": ["message"],
                        "additionalProperties": False,
                    },
                }
            ],
        },
    ],
}
BODY: dict[str, Any] = {
    "model": "gpt-6.1-sol",
    "stream": True,
    "input": [
        ADDITIONAL_TOOLS,
        {
            "type": "message",
            "id": "msg_01a244aa-2fb1-71b1-91c8-2d8cc6776bec",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are Codex, an agent based on GPT-6."}],
        },
        {
            "type": "message",
            "id": "msg_01a244aa-2fc0-7341-a4ef-253c0dcdb6aa",
            "role": "user",
            "content": [{"type": "input_text", "text": "say hi"}],
        },
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "low", "context": "all_turns"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "01a244aa-2f42-7d20-9178-705747501dbc",
    "text": {"verbosity": "low"},
    "client_metadata": {
        "turn_id": "01a244aa-2f56-7661-8365-048cfff4e2cb",
        "session_id": "01a244aa-2f42-7d20-9178-705747501dbc",
    },
}
#: The names the model calls, in declaration order.
CALLED = ["functions.exec", "functions.wait", "clock.sleep", "collaboration.spawn_agent"]


def body() -> dict[str, Any]:
    """A fresh copy of the captured body."""
    return copy.deepcopy(BODY)


def send(client: openai.OpenAI, sent: dict[str, Any]) -> Any:
    """One call through the openai SDK with `sent` as Codex sends it (fields the SDK does
    not name go as they are); the response, from `response.completed` when streamed."""
    rest = {k: v for k, v in sent.items() if k not in ("model", "input", "stream")}
    if not sent.get("stream"):
        return client.responses.create(model=sent["model"], input=sent["input"], extra_body=rest)
    events = client.responses.create(
        model=sent["model"], input=sent["input"], stream=True, extra_body=rest
    )
    (done,) = [e for e in events if e.type == "response.completed"]
    return done.response

"""Anthropic Messages as Claude Code at its defaults speaks it, in text mode: signed and
redacted thinking, server-tool blocks and images in tool results relayed, recorded and
replayed on one path (the unchanged anthropic SDK through skycap to the scripted upstream)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from server_fixtures import Control, ServerThread, anthropic_sdk

from skycap.dialects.messages import DIALECT as MESSAGES
from skycap.hashing import message_hash
from skycap.mock.anthropic import ScriptedAnthropicUpstream
from skycap.mock.replies import Reply
from skycap.server.options import ServerOptions

REDACTED = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}
SEARCH = {
    "type": "server_tool_use",
    "id": "srvtoolu_01",
    "name": "web_search",
    "input": {"query": "weather paris"},
}
RESULT = {
    "type": "web_search_tool_result",
    "tool_use_id": "srvtoolu_01",
    "content": [
        {
            "type": "web_search_result",
            "url": "https://example.com/paris",
            "title": "Paris weather",
            "encrypted_content": "EqgfCioIARgBIiQ3",
        }
    ],
}
SHOT = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
BASH = {"id": "toolu_01", "function": {"name": "Bash", "arguments": '{"command": "shot"}'}}
TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]


def script(body: dict[str, Any]) -> Reply:
    """Think, search the web and call Bash; after the tool result, answer."""
    last = body["messages"][-1]["content"]
    if isinstance(last, list) and any(b.get("type") == "tool_result" for b in last):
        return Reply(reasoning_content="Seen.", content="Sunny.")
    return Reply(
        reasoning_content="Search first.",
        hosted=[REDACTED, SEARCH, RESULT],
        content="Taking a screenshot.",
        tool_calls=[BASH],
    )


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedAnthropicUpstream]:
    with ScriptedAnthropicUpstream(script) as mock:
        yield mock


@pytest.fixture(scope="module")
def server(upstream: ScriptedAnthropicUpstream) -> Iterator[ServerThread]:
    with ServerThread(ServerOptions(upstream.base_url, upstream_timeout=5.0)) as server:
        yield server


@pytest.fixture
def control(server: ServerThread) -> Iterator[Control]:
    with Control(server.url) as client:
        yield client


def test_server_tool_blocks_and_redacted_thinking_replay_on_one_path(
    control: Control, upstream: ScriptedAnthropicUpstream
) -> None:
    created = control.create()
    client = anthropic_sdk(created)
    thinking = {"thinking": {"type": "adaptive", "display": "omitted"}}
    user = {"role": "user", "content": "What is the weather in Paris?"}
    with client.messages.stream(
        model="claude", max_tokens=200, messages=[user], tools=TOOLS, extra_body=thinking
    ) as stream:
        first = stream.get_final_message()
    kinds = [b.type for b in first.content]
    assert kinds[:4] == [
        "thinking",
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
    ]
    # Sent back as received (JSON, no nulls added), as Claude Code does.
    turn = {
        "role": "assistant",
        "content": [b.model_dump(exclude_none=True) for b in first.content],
    }
    result = {"type": "tool_result", "tool_use_id": "toolu_01", "content": [SHOT]}
    second = client.messages.create(
        model="claude",
        max_tokens=200,
        messages=[user, turn, {"role": "user", "content": [result]}],
        tools=TOOLS,
        extra_body=thinking,
    )
    assert second.content[-1].text == "Sunny."
    assert orjson.loads(upstream.requests[-1].body)["messages"][1]["content"][2] == SEARCH

    (sample,) = control.finish(created["id"]).json()["samples"]  # one path
    _, assistant, tool, answer = sample["messages"]
    assert assistant["content"] == [
        {"type": "opaque", "dialect": "messages", "value": SEARCH},
        {"type": "opaque", "dialect": "messages", "value": RESULT},
        {"type": "text", "text": "Taking a screenshot."},
    ]
    assert assistant["thinking_blocks"][1] == REDACTED
    assert tool["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    ]
    assert answer["content"] == "Sunny."


def test_unread_blocks_and_roles_are_opaque_and_token_mode_names_them() -> None:
    body = {
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": [{"type": "document", "source": {"type": "text"}}]},
            {"role": "assistant", "content": [SEARCH | {"cache_control": {"type": "ephemeral"}}]},
            {"role": "critic", "content": "no"},
        ],
    }
    request = MESSAGES.read(body)
    document, search, critic = request.messages
    assert document["content"] == [
        {"type": "opaque", "dialect": "messages", "value": body["messages"][0]["content"][0]}
    ]
    assert search["content"] == [{"type": "opaque", "dialect": "messages", "value": SEARCH}]
    assert critic == {
        "role": "critic",
        "content": [{"type": "opaque", "dialect": "messages", "value": body["messages"][2]}],
    }
    assert request.token_refusal is not None
    assert request.token_refusal.startswith("messages[0].content[0] has type 'document'")
    (replayed,) = MESSAGES.read({"max_tokens": 5, "messages": body["messages"][1:2]}).messages
    assert message_hash(replayed) == message_hash(search)  # the marker moved, same node

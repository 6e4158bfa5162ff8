"""Token mode streams as the engine generates (D-51): all three SDKs, keep-alives, faults."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from server_fixtures import Control, ServerThread, control, wait_for

from skycap.mock.engine import Reply, ScriptedEngine, scripted_logprob

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]
START = [{"role": "user", "content": "find x"}]
THOUGHT = "<think>\nI will look it up, carefully: 日本語 and émoji 🙂.\n</think>\n\n"
ANSWER = "The answer is 42 — café 🙂, done."


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer: Any) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer) as engine:
        engine.stream_chunk = 1  # every token its own chunk: characters split across chunks
        yield engine


@pytest.fixture(scope="module")
def server(
    engine: ScriptedEngine, qwen3_renderer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    from skycap.server.options import ServerOptions

    options = ServerOptions(
        engine.url,
        mode="tokens",
        renderer=qwen3_renderer,
        record_dir=tmp_path_factory.mktemp("records"),
        keepalive=0.05,
    )
    with ServerThread(options) as server:
        yield server


@pytest.fixture(autouse=True)
def _engine_reset(engine: ScriptedEngine) -> Iterator[None]:
    yield
    engine.resume_stream()
    engine.clear_faults()
    engine.first_token_delay = 0.0


def _chat(trajectory: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )


def test_chat_stream_relays_deltas_as_the_engine_generates(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    engine.queue(THOUGHT + ANSWER)
    engine.hold_stream(before_chunk=12)
    stream = _chat(trajectory).chat.completions.create(model="p", messages=START, stream=True)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and getattr(delta, "reasoning_content", None):
            break
    # The first reasoning delta came while the engine was held mid-generation.
    assert engine.streams_finished == 0
    engine.resume_stream()
    chunks.extend(stream)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    # Joined, the stream is the non-streamed reply and the stored node.
    nodes = control.document(trajectory["id"]).json()["nodes"]
    stored = nodes[-1]["message"]
    assert content == stored["content"] == ANSWER
    assert reasoning == stored["reasoning_content"]

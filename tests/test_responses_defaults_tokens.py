"""Token mode at Codex's defaults: its namespaced and custom tools rendered, a custom tool's
call answered as a `custom_tool_call` and replayed on one bridged path, and what it cannot
render refused at the first call (the real openai SDK, the Qwen3 renderer, the scripted
engine)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from codex_defaults import CALLED, body, send
from server_fixtures import Control, ServerThread, TextScript

from skycap.mock.engine import ScriptedEngine
from skycap.server.options import ServerOptions

CODE = 'text("hi")'


class Script(TextScript):
    """Call `functions.exec` until the prompt holds its output, then answer."""

    def text(self, prompt: list[int]) -> str:
        last_user = self.tokenizer.decode(prompt).rpartition("<|im_start|>user")[2]
        if "<tool_response>" in last_user:
            return "<think>\nIt printed.\n</think>\n\nhi"
        call = '{"name": "functions.exec", "arguments": {"input": "text(\\"hi\\")"}}'
        return f"<think>\nRun it.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer: Any) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer, script=Script(qwen3_tokenizer), model="policy") as mock:
        yield mock


@pytest.fixture(scope="module")
def server(engine: ScriptedEngine, qwen3_renderer: Any) -> Iterator[ServerThread]:
    options = ServerOptions(engine.url, mode="tokens", renderer=qwen3_renderer, model="policy")
    thread = ServerThread(options)
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture
def control(server: ServerThread) -> Iterator[Control]:
    with Control(server.url) as client:
        yield client


def test_codex_default_tools_render_and_a_custom_call_round_trips_on_one_path(
    control: Control, engine: ScriptedEngine, qwen3_tokenizer: Any
) -> None:
    trajectory = control.create()
    client = openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )
    first = send(client, body())
    prompt = qwen3_tokenizer.decode(engine.requests[-1].body["token_ids"])
    assert all(f'"name": "{name}"' in prompt for name in CALLED)
    assert "lark grammar" in prompt
    reasoning, call = first.output
    assert (call.type, call.namespace, call.name, call.input) == (
        "custom_tool_call",
        "functions",
        "exec",
        CODE,
    )
    second_body = body()
    del second_body["stream"]  # a JSON reply this time
    second_body["input"] += [
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "hi"},
    ]
    second = send(client, second_body)
    assert second.output_text == "hi"
    document = control.document(trajectory["id"]).json()
    calls = [c for node in document["nodes"] for c in node["calls"]]
    assert [c["bridged"] for c in calls] == [None, True]
    assert "omitted_tools" not in calls[0]
    finished = control.finish(trajectory["id"]).json()
    assert finished["unbridged_calls"] == 0 and len(finished["samples"]) == 1


def test_what_token_mode_cannot_render_is_refused_at_the_first_call(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    client = openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )
    sent = body()
    sent["input"].append({"type": "web_search_call", "id": "ws_1", "status": "completed"})
    before = len(engine.requests)
    with pytest.raises(openai.BadRequestError) as caught:
        send(client, sent)
    message = caught.value.body["message"]
    assert message.startswith("input[3] has type 'web_search_call'")
    assert "--mode text" in message and len(engine.requests) == before

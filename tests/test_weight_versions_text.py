"""Text mode records the weight versions a vLLM upstream attaches to Chat Completions,
Messages and Responses answers, streamed or not, through the unchanged SDKs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest
from server_fixtures import Control, ServerThread, anthropic_sdk

from skycap.mock.anthropic import ScriptedAnthropicUpstream
from skycap.mock.replies import Reply
from skycap.mock.responses import ScriptedResponsesUpstream
from skycap.mock.upstream import ScriptedUpstream
from skycap.server.options import ServerOptions

SPANS = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 6}]
USER = [{"role": "user", "content": "hi"}]


def chat(created: dict[str, Any], stream: bool) -> None:
    client = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    reply = client.chat.completions.create(model="p", messages=USER, stream=stream)
    if stream:
        list(reply)


def messages(created: dict[str, Any], stream: bool) -> None:
    client = anthropic_sdk(created)
    if stream:
        with client.messages.stream(model="p", max_tokens=32, messages=USER) as events:
            events.get_final_message()
    else:
        client.messages.create(model="p", max_tokens=32, messages=USER)


def responses(created: dict[str, Any], stream: bool) -> None:
    client = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    reply = client.responses.create(model="p", input="hi", stream=stream)
    if stream:
        list(reply)


CASES: dict[str, tuple[type[ScriptedUpstream], Callable[[dict[str, Any], bool], None]]] = {
    "chat": (ScriptedUpstream, chat),
    "messages": (ScriptedAnthropicUpstream, messages),
    "responses": (ScriptedResponsesUpstream, responses),
}


@pytest.mark.parametrize("dialect", list(CASES))
def test_spans_on_an_answer_are_recorded_on_the_call(dialect: str) -> None:
    upstream_class, call = CASES[dialect]
    answers = [Reply(content="hello there", weight_versions=SPANS), Reply(content="plain")] * 2
    with (
        upstream_class(answers) as upstream,
        ServerThread(ServerOptions(upstream.base_url, upstream_timeout=5.0)) as server,
        Control(server.url) as control,
    ):
        recorded = []
        for stream in (False, True):
            for _ in range(2):  # one answer with spans, one without
                created = control.create()
                call(created, stream)
                document = control.document(created["id"]).json()
                (node,) = [n for n in document["nodes"] if n["author"] == "model"]
                recorded.append(node["calls"][0].get("weight_versions"))
                assert set(document["provenance"]) == {"skycap"}
    assert recorded == [SPANS, None, SPANS, None]

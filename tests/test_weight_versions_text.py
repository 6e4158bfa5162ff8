"""Text mode records the weight versions a vLLM upstream attaches to Chat Completions,
Messages and Responses answers, streamed or not, through the unchanged SDKs, and asks a
vLLM upstream for them (`--upstream-weight-versions`) where its API needs asking."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import orjson
import pytest
from server_fixtures import Control, ServerThread, anthropic_sdk

from skycap.mock.anthropic import ScriptedAnthropicUpstream
from skycap.mock.replies import Reply
from skycap.mock.responses import ScriptedResponsesUpstream
from skycap.mock.upstream import ScriptedUpstream
from skycap.server.options import ServerOptions
from skycap.server.textmode import with_member

SPANS = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 6}]
USER = [{"role": "user", "content": "hi"}]


def chat(created: dict[str, Any], stream: bool, **extra: Any) -> None:
    client = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    reply = client.chat.completions.create(model="p", messages=USER, stream=stream, **extra)
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
    options = {"upstream_timeout": 5.0, "upstream_weight_versions": True}
    with (
        upstream_class(answers) as upstream,
        ServerThread(ServerOptions(upstream.base_url, **options)) as server,
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


def test_chat_answers_carry_versions_only_when_asked() -> None:
    """vLLM's Chat Completions report weight versions only to a request that asks: without
    the option the harness's body goes upstream byte for byte and nothing is recorded; with
    it the body gains the one member, and a harness's own `false` still wins."""
    answers = [Reply(content="hello there", weight_versions=SPANS)] * 3
    recorded = []
    harness_says_no = {"extra_body": {"return_weight_versions": False}}
    for ask, extra in ((False, {}), (True, {}), (True, harness_says_no)):
        with (
            ScriptedUpstream(answers[:1]) as upstream,
            ServerThread(ServerOptions(upstream.base_url, upstream_weight_versions=ask)) as server,
            Control(server.url) as control,
        ):
            created = control.create()
            chat(created, False, **extra)
            (sent,) = upstream.requests
            body = orjson.loads(sent.body)
            document = control.document(created["id"]).json()
            (node,) = [n for n in document["nodes"] if n["author"] == "model"]
            recorded.append(node["calls"][0].get("weight_versions"))
            if not ask:
                assert b"return_weight_versions" not in sent.body
            else:
                assert sent.body.startswith(b'{"return_weight_versions":true,')
                assert body["messages"] == USER
    assert recorded == [None, SPANS, None]


@pytest.mark.parametrize("dialect", ["messages", "responses"])
def test_apis_without_the_field_go_upstream_unchanged(dialect: str) -> None:
    upstream_class, call = CASES[dialect]
    with (
        upstream_class([Reply(content="hi")]) as upstream,
        ServerThread(ServerOptions(upstream.base_url, upstream_weight_versions=True)) as server,
        Control(server.url) as control,
    ):
        call(control.create(), False)
        (sent,) = upstream.requests
    assert b"return_weight_versions" not in sent.body


def test_the_member_is_spliced_into_the_object() -> None:
    member = b'"return_weight_versions":true'
    assert with_member(b'{"a":1}', member) == b'{"return_weight_versions":true,"a":1}'
    assert with_member(b"  {  }", member) == b'  {"return_weight_versions":true  }'
    assert with_member(b'{\n"a": {"b": 2}}', member) == (
        b'{"return_weight_versions":true,\n"a": {"b": 2}}'
    )
    for body in (b'{"a":1}', b"  {  }", b'{"x": [1, {"y": 2}]}'):
        assert orjson.loads(with_member(body, member))["return_weight_versions"] is True


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"mode": "tokens", "tokenizer": "t"}, "is a text-mode option"),
        ({"proxy_port": 0, "upstream_url": None}, "none is given"),
    ],
)
def test_the_option_is_refused_where_it_means_nothing(keywords: dict, message: str) -> None:
    arguments = {"upstream_url": "http://127.0.0.1:9", "upstream_weight_versions": True}
    with pytest.raises(ValueError, match=message):
        ServerOptions(**(arguments | keywords))

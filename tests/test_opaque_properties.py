"""Property: text mode records what it does not read, in all three dialects, over sockets.

A request with item, part, block and tool types skycap does not read, at random places, and
top-level fields it does not know, is forwarded byte for byte, recorded with each unread
value kept as sent in an opaque part, and a harness's replay of it (with the reply's own
unread items, as returned) lands on the same nodes: the trajectory stays one path
(docs/format.md §9, opaque parts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import Control, ServerThread

from skycap.dialects.chat import DIALECT as CHAT
from skycap.mock.anthropic import ScriptedAnthropicUpstream
from skycap.mock.replies import Reply
from skycap.mock.responses import ScriptedResponsesUpstream
from skycap.mock.upstream import ScriptedUpstream
from skycap.server.options import ServerOptions
from skycap.viewer.derive import message_text

PROPERTY = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
LEAF = st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8)
VALUE = st.recursive(
    LEAF,
    lambda children: (
        st.lists(children, max_size=2) | st.dictionaries(st.text(max_size=4), children, max_size=2)
    ),
    max_leaves=6,
)
#: Keys an unread value may carry: anything but the ones skycap reads on every item.
KEY = st.from_regex(r"[a-z_]{1,6}", fullmatch=True).filter(
    lambda k: k not in ("type", "role", "cache_control")
)
UNREAD_TYPE = st.from_regex(r"x_[a-z]{1,6}", fullmatch=True)


@st.composite
def unread(draw: st.DrawFn, role: str | None = None) -> dict[str, Any]:
    """A value of a type no API has (so no dialect reads it), with fields of any JSON."""
    value = draw(st.dictionaries(KEY, VALUE, max_size=3))
    value["type"] = draw(UNREAD_TYPE)
    if role is not None:
        value["role"] = role
    return value


def inserted(draw: st.DrawFn, items: list[Any], values: st.SearchStrategy[Any]) -> list[Any]:
    """`items` with 0 to 3 drawn values at drawn places (never after the last item)."""
    out = list(items)
    for value in draw(st.lists(values, max_size=3)):
        out.insert(draw(st.integers(0, len(out) - 1)), value)
    return out


def top_level(draw: st.DrawFn) -> dict[str, Any]:
    """Top-level fields the API may add later."""
    return draw(st.dictionaries(st.from_regex(r"x_[a-z]{1,6}", fullmatch=True), VALUE, max_size=2))


# -- the three dialects: a body, the reply's replay, and the upstream's script -----------------


@st.composite
def chat_body(draw: st.DrawFn) -> dict[str, Any]:
    parts = inserted(
        draw, [{"type": "text", "text": "hi"}, {"type": "text", "text": "?"}], unread()
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": inserted(draw, [{"type": "text", "text": "go"}], unread())},
    ]
    return {"model": "policy", "messages": messages, **top_level(draw)}


def chat_replay(body: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    message = reply["choices"][0]["message"]
    return {**body, "messages": [*body["messages"], message, {"role": "user", "content": "more"}]}


@st.composite
def messages_body(draw: st.DrawFn) -> dict[str, Any]:
    text = {"type": "text", "text": "hi"}
    messages = [
        {"role": "user", "content": inserted(draw, [text, text], unread())},
        {
            "role": "assistant",
            "content": inserted(draw, [{"type": "text", "text": "ok"}], unread()),
        },
        {"role": "user", "content": inserted(draw, [text], unread())},
    ]
    tools = inserted(draw, [{"name": "f", "input_schema": {"type": "object"}}], unread())
    body = {"model": "policy", "max_tokens": 50, "messages": messages, "tools": tools}
    return body | {"system": inserted(draw, [text], unread())} | top_level(draw)


def messages_replay(body: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    turn = {"role": "assistant", "content": reply["content"]}
    return {**body, "messages": [*body["messages"], turn, {"role": "user", "content": "more"}]}


@st.composite
def responses_body(draw: st.DrawFn) -> dict[str, Any]:
    text = {"type": "input_text", "text": "hi"}
    user = {"type": "message", "role": "user", "content": inserted(draw, [text, text], unread())}
    items = [
        {"type": "additional_tools", "role": "developer", "tools": [{"type": "web_search"}]},
        {"type": "message", "role": "developer", "content": "Be brief."},
        user,
        {"role": "user", "content": "go"},
    ]
    items = inserted(draw, items, unread() | unread("developer") | unread("user"))
    tools = inserted(draw, [{"type": "function", "name": "f"}], unread())
    return {"model": "policy", "input": items, "tools": tools, **top_level(draw)}


def responses_replay(body: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    more = {"role": "user", "content": "more"}
    return {**body, "input": [*body["input"], *reply["output"], more]}


SEARCH = {"type": "web_search_call", "id": "ws_1", "status": "completed"}
SEARCH_BLOCKS = [
    {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"q": "x"}},
    {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
]
DIALECTS: dict[str, tuple[Callable[[], ScriptedUpstream], str, Any, Any]] = {
    "chat": (
        lambda: ScriptedUpstream([Reply(content="Fine.")] * 100),
        "chat/completions",
        chat_body(),
        chat_replay,
    ),
    "messages": (
        lambda: ScriptedAnthropicUpstream(lambda _: Reply(hosted=SEARCH_BLOCKS, content="Fine.")),
        "messages",
        messages_body(),
        messages_replay,
    ),
    "responses": (
        lambda: ScriptedResponsesUpstream(lambda _: Reply(hosted=[SEARCH], content="Fine.")),
        "responses",
        responses_body(),
        responses_replay,
    ),
}


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, ServerThread, ScriptedUpstream]]:
    """The dialect, its scripted upstream and a text-mode server in front of it (one
    server at a time: pytest groups the tests by the parameter)."""
    with DIALECTS[request.param][0]() as upstream:
        thread = ServerThread(ServerOptions(upstream.base_url, upstream_timeout=5.0))
        thread.start()
        yield request.param, thread, upstream
        thread.stop()


def unread_values(value: Any) -> list[Any]:
    """The values of every `x_…` type inside `value`, outermost first."""
    if isinstance(value, list):
        return [v for item in value for v in unread_values(item)]
    if not isinstance(value, dict):
        return []
    if isinstance(value.get("type"), str) and value["type"].startswith("x_"):
        return [value]
    return [v for item in value.values() for v in unread_values(item)]


def opaque_values(messages: list[dict[str, Any]]) -> list[Any]:
    return [
        part["value"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "opaque"
    ]


@pytest.mark.parametrize("served", list(DIALECTS), indirect=True)
def test_unread_types_are_forwarded_recorded_and_replayed_on_one_path(
    served: tuple[str, ServerThread, ScriptedUpstream],
) -> None:
    dialect, server, upstream = served
    _, route, bodies, replay = DIALECTS[dialect]

    @PROPERTY
    @given(body=bodies)
    def check(body: dict[str, Any]) -> None:
        with Control(server.url) as control:
            created = control.create()
            base = (
                created["anthropic_base_url"] + "/v1"
                if dialect == "messages"
                else created["base_url"]
            )
            headers = {
                "authorization": f"Bearer {created['api_key']}",
                "x-api-key": created["api_key"],
                "anthropic-version": "2023-06-01",
                "content-type": "application/json",
            }
            replies = []
            for sent in (body, None):
                sent = sent if sent is not None else replay(body, replies[-1])
                raw = orjson.dumps(sent)
                answer = httpx.post(f"{base}/{route}", content=raw, headers=headers, timeout=20)
                assert answer.status_code == 200, answer.text
                assert upstream.requests[-1].body == raw  # forwarded byte for byte
                replies.append(answer.json())
            (sample,) = control.finish(created["id"]).json()["samples"]  # one path
        kept = opaque_values(sample["messages"])
        for value in unread_values(body.get("messages", body.get("input"))):
            assert value in kept

    check()


def test_token_mode_names_what_it_cannot_render_in_chat() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}
    request = CHAT.read({"messages": [{"role": "user", "content": [audio]}]})
    assert request.messages[0]["content"] == [{"type": "opaque", "dialect": "chat", "value": audio}]
    assert request.token_refusal is not None
    assert request.token_refusal.startswith("messages[0].content[0] has type 'input_audio'")
    custom = {"type": "custom", "custom": {"name": "exec"}}
    request = CHAT.read({"messages": [{"role": "user", "content": "x"}], "tools": [custom]})
    assert request.token_refusal is not None
    assert request.token_refusal.startswith("tools[0] has type 'custom'")


def test_a_reader_sees_what_an_opaque_part_holds() -> None:
    search = {"type": "opaque", "dialect": "responses", "value": {"type": "web_search_call"}}
    message = {"role": "assistant", "content": [search, {"type": "text", "text": "Sunny."}]}
    assert message_text(message) == "[web_search_call]\nSunny."

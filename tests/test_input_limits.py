"""Hostile input over real sockets: deep JSON on every route, fuzzed bodies, never a 5xx."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import Control, ServerThread, bearer

from skycap.mock.upstream import ScriptedUpstream
from skycap.record.reader import read_document
from skycap.server.options import ServerOptions
from skycap.wire import MAX_DEPTH, BodyError, check_depth, parse_json_body

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def nested(levels: int) -> Any:
    """A value that is `levels` levels deep: objects and arrays inside each other."""
    value: Any = "leaf"
    for level in range(levels):
        value = {"k": value} if level % 2 else [value]
    return value


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with ScriptedUpstream() as upstream:
        record_dir = tmp_path_factory.mktemp("records")
        service = ServerThread(ServerOptions(upstream.base_url, record_dir=record_dir))
        service.start()
        yield service
        service.stop()


@pytest.fixture
def control(server: ServerThread) -> Iterator[Control]:
    with Control(server.url) as client:
        yield client


def test_the_limit_counts_levels_from_the_body() -> None:
    assert parse_json_body(orjson.dumps(nested(MAX_DEPTH))) is not None
    for levels in (MAX_DEPTH + 1, 300, 1000, 5000):
        raw = b"[" * levels + b"]" * levels
        with pytest.raises(BodyError, match=f"deeper than {MAX_DEPTH} levels"):
            parse_json_body(raw)
    check_depth({"fine": [1, 2, {"x": None}]})
    with pytest.raises(BodyError, match="the meta nests"):
        check_depth(nested(MAX_DEPTH + 1), "the meta")
    # A large, flat body is walked rather than counted and still accepted.
    wide = orjson.dumps({"messages": [{"role": "user", "content": "[{" * 40_000}]})
    assert parse_json_body(wide)["messages"][0]["role"] == "user"


def test_deep_meta_is_refused_at_create_and_the_listing_keeps_working(
    control: Control,
) -> None:
    response = control.http.post("/trajectories", json={"meta": nested(300)})
    assert response.status_code == 400
    assert f"deeper than {MAX_DEPTH} levels" in response.json()["error"]
    deepest = control.create({"deep": nested(MAX_DEPTH - 2)})  # body, meta, "deep": 128
    listing = control.http.get("/trajectories")
    assert listing.status_code == 200
    assert deepest["id"] in [row["id"] for row in listing.json()]
    assert control.finish(deepest["id"]).status_code == 200


def test_deep_annotations_are_refused_and_the_trajectory_finishes_later(
    control: Control, server: ServerThread
) -> None:
    created = control.create({"task": "deep-annotations"})
    refused = control.finish(created["id"], annotations={"reward": 1, "trace": nested(200)})
    assert refused.status_code == 400 and str(MAX_DEPTH) in refused.json()["error"]
    finished = control.finish(created["id"], annotations={"reward": 1})
    assert finished.status_code == 200, finished.text
    document = read_document(Path(finished.json()["record"]["path"]))
    assert document["annotations"] == {"reward": 1}


@pytest.mark.parametrize("where", ["content", "tool_arguments", "extra_key"])
def test_a_deep_chat_body_is_a_400_in_the_openai_shape(control: Control, where: str) -> None:
    created = control.create()
    message: dict[str, Any] = {"role": "user", "content": "hi"}
    body: dict[str, Any] = {"model": "m", "messages": [message]}
    if where == "content":
        message["content"] = [{"type": "text", "text": "x", "extra": nested(200)}]
    elif where == "tool_arguments":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": nested(150)}}]
    else:
        body["metadata"] = nested(MAX_DEPTH)  # inside the body: one level too many
    response = httpx.post(f"{created['base_url']}/chat/completions", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and str(MAX_DEPTH) in error["message"]
    document = control.document(created["id"]).json()
    assert document["nodes"] == []  # refused calls record nothing


# -- fuzzing: whatever the body, a 4xx or a 200, never a 5xx or a traceback -----------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x", 3, None])},
    optional={
        "content": JSON | st.text(max_size=40),
        "tool_calls": JSON,
        "tool_call_id": JSON,
        "name": JSON,
    },
)
CHAT = st.fixed_dictionaries(
    {},
    optional={
        "model": JSON,
        "messages": st.lists(MESSAGE, max_size=4) | JSON,
        "stream": st.booleans() | JSON,
        "n": JSON,
        "temperature": JSON,
        "max_tokens": JSON,
        "tools": JSON,
        "stream_options": JSON,
    },
)
RAW = st.binary(max_size=200) | st.sampled_from(
    [b"", b"{", b'{"messages": [', b"\xff\xfe", b'{"a": "\\ud800"}', b"[" * 2000, b"1e999"]
)


def _no_server_error(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    assert "Traceback" not in response.text


@FUZZ
@given(body=CHAT | JSON)
def test_fuzzed_chat_bodies(control: Control, body: Any) -> None:
    created = control.create({"fuzz": "chat"})
    url = f"{created['base_url']}/chat/completions"
    _no_server_error(httpx.post(url, content=json.dumps(body), timeout=10))


@FUZZ
@given(raw=RAW)
def test_fuzzed_raw_bytes_on_every_route(control: Control, raw: bytes) -> None:
    created = control.create({"fuzz": "raw"})
    for url, headers in (
        (f"{created['base_url']}/chat/completions", {}),
        (f"{control.url}/trajectories", None),
        (f"{control.url}/trajectories/{created['id']}/finish", None),
    ):
        sent = (
            control.http.post(url, content=raw) if headers is None else httpx.post(url, content=raw)
        )
        _no_server_error(sent)


@FUZZ
@given(
    create=st.fixed_dictionaries({}, optional={"meta": JSON}) | JSON,
    finish=st.fixed_dictionaries({}, optional={"annotations": JSON, "paths": JSON}) | JSON,
)
def test_fuzzed_create_and_finish_bodies(control: Control, create: Any, finish: Any) -> None:
    response = control.http.post("/trajectories", content=json.dumps(create))
    _no_server_error(response)
    trajectory_id = response.json()["id"] if response.status_code == 200 else control.create()["id"]
    _no_server_error(
        control.http.post(f"/trajectories/{trajectory_id}/finish", content=json.dumps(finish))
    )
    assert control.http.get("/trajectories").status_code == 200

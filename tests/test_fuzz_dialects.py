"""Fuzzed Anthropic Messages and Responses bodies over real sockets, in text and token mode.

Whatever the body, skycap answers a 200 or a 4xx in the caller's own error shape with a
message, never a 5xx or a traceback (in the answer or the server's log), and keeps
serving (issue 17's fuzzing; chat, create, finish and raw bytes are fuzzed in
test_input_limits.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import Control, ServerThread

from skycap.mock.anthropic import ScriptedAnthropicUpstream
from skycap.mock.responses import ScriptedResponsesUpstream
from skycap.server.options import ServerOptions

FUZZ = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)  # past 64 bits: test_input_limits
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=12,
)
TEXT = st.text(max_size=30)


def ok(*valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Five times in six one of the `valid` values, else any JSON: so bodies reach the readers."""
    return st.one_of(*valid * 5, JSON)


def _object(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries(required, optional=optional)


NAME = ok(st.sampled_from(["search", "get_weather", "x" * 70, ""]))
SCHEMA = ok(st.just({"type": "object", "properties": {"q": {"type": "string"}}}))

# -- Anthropic Messages ------------------------------------------------------------------------

CALL_ID = ok(st.sampled_from(["toolu_1", "toolu_2"]))
BLOCK = st.one_of(
    _object({"type": st.just("text"), "text": ok(TEXT)}, {"cache_control": JSON}),
    _object({"type": st.just("thinking"), "thinking": ok(TEXT)}, {"signature": JSON}),
    _object({"type": st.just("tool_use"), "id": CALL_ID, "name": NAME}, {"input": JSON}),
    _object(
        {"type": st.just("tool_result"), "tool_use_id": CALL_ID},
        {
            "content": ok(TEXT, st.lists(_object({"type": st.just("text")}, {"text": TEXT}))),
            "is_error": JSON,
        },
    ),
    _object({"type": ok(st.just("image"))}, {"source": JSON}),
    _object(
        {"type": ok(st.sampled_from(["redacted_thinking", "document", "server_tool_use"]))},
        {"data": JSON},
    ),
)
ANTHROPIC_MESSAGE = _object(
    {
        "role": ok(st.sampled_from(["user", "assistant"]), st.just("system")),
        "content": ok(TEXT, st.lists(BLOCK, min_size=1, max_size=3)),
    },
    {},
)
ANTHROPIC_TOOL = ok(
    _object({"name": NAME, "input_schema": SCHEMA}, {"description": ok(TEXT)}),
    _object({"type": st.sampled_from(["web_search_20250305", "bash_20250124"])}, {"name": NAME}),
)
ANTHROPIC_TOOL_CHOICE = ok(
    _object(
        {"type": ok(st.sampled_from(["auto", "any", "none", "tool"]))},
        {"name": NAME, "disable_parallel_tool_use": ok(st.booleans())},
    )
)
MESSAGES = _object(
    {
        "model": ok(st.just("policy")),
        "max_tokens": ok(st.integers(min_value=1, max_value=64)),
        "messages": ok(st.lists(ANTHROPIC_MESSAGE, min_size=1, max_size=4)),
    },
    {
        "system": ok(TEXT, st.lists(BLOCK, max_size=2)),
        "stream": ok(st.booleans()),
        "tools": ok(st.lists(ANTHROPIC_TOOL, max_size=2)),
        "tool_choice": ANTHROPIC_TOOL_CHOICE,
        "stop_sequences": ok(st.lists(TEXT, max_size=2)),
        "temperature": ok(st.floats(0, 2)),
        "top_p": ok(st.floats(0, 1)),
        "top_k": ok(st.integers(0, 100)),
        "thinking": JSON,
        "metadata": JSON,
    },
)

# -- Responses ---------------------------------------------------------------------------------

FC_ID = ok(st.sampled_from(["call_1", "call_2"]))
PART = st.one_of(
    _object({"type": ok(st.sampled_from(["input_text", "output_text"])), "text": ok(TEXT)}, {}),
    _object({"type": ok(st.just("input_image"))}, {"image_url": JSON, "detail": JSON}),
    _object({"type": ok(st.just("refusal"))}, {"refusal": JSON}),
)
ITEM = st.one_of(
    _object(
        {
            "type": ok(st.just("message")),
            "role": ok(st.sampled_from(["user", "system", "developer", "assistant"])),
            "content": ok(TEXT, st.lists(PART, min_size=1, max_size=2)),
        },
        {"id": JSON, "status": JSON},
    ),
    _object(
        {"type": st.just("function_call"), "call_id": FC_ID, "name": NAME},
        {"arguments": ok(st.just('{"city": "Paris"}'), TEXT), "id": JSON},
    ),
    _object(
        {"type": st.just("function_call_output"), "call_id": FC_ID},
        {"output": ok(TEXT, st.lists(PART, max_size=2))},
    ),
    _object(
        {"type": st.just("reasoning")},
        {
            "summary": ok(
                st.lists(_object({"type": st.just("summary_text"), "text": TEXT}, {}), max_size=2)
            ),
            "content": JSON,
            "encrypted_content": ok(
                st.sampled_from(["skycap.r1.", "skycap.r1.e30", "skycap.r1.!!", "opaque"])
            ),
            "id": JSON,
        },
    ),
    _object(
        {"type": ok(st.sampled_from(["compaction", "item_reference", "web_search_call"]))},
        {"encrypted_content": JSON, "id": JSON},
    ),
)
RESPONSES_TOOL = ok(
    _object(
        {"type": st.just("function"), "name": NAME},
        {"parameters": SCHEMA, "description": ok(TEXT), "strict": ok(st.booleans())},
    ),
    _object(
        {"type": ok(st.sampled_from(["custom", "web_search", "namespace", "local_shell"]))},
        {"name": NAME, "tools": JSON, "format": JSON},
    ),
)
RESPONSES_TOOL_CHOICE = ok(
    st.sampled_from(["auto", "none", "required"]),
    _object({"type": st.just("function"), "name": NAME}, {}),
    _object(
        {"type": st.just("allowed_tools"), "mode": ok(st.sampled_from(["auto", "required"]))},
        {"tools": ok(st.lists(_object({"type": st.just("function"), "name": NAME}, {})))},
    ),
)
RESPONSES = _object(
    {
        "model": ok(st.just("policy")),
        "input": ok(TEXT, st.lists(ITEM, min_size=1, max_size=4)),
    },
    {
        "instructions": ok(TEXT),
        "stream": ok(st.booleans()),
        "store": ok(st.booleans()),
        "tools": ok(st.lists(RESPONSES_TOOL, max_size=2)),
        "tool_choice": RESPONSES_TOOL_CHOICE,
        "parallel_tool_calls": ok(st.booleans()),
        "previous_response_id": ok(st.just("resp_unknown")),
        "max_output_tokens": ok(st.integers(min_value=1, max_value=64)),
        "temperature": ok(st.floats(0, 2)),
        "top_p": ok(st.floats(0, 1)),
        "text": ok(
            st.just({"format": {"type": "text"}}), st.just({"format": {"type": "json_object"}})
        ),
        "include": ok(st.just(["reasoning.encrypted_content"])),
        "reasoning": ok(st.just({"effort": "low"})),
        "truncation": ok(st.sampled_from(["auto", "disabled"])),
    },
)


# -- servers: one per mode, shared by the module -----------------------------------------------


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest,
    token_server_options: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerThread]:
    """The server a test's `server` parameter names; pytest groups the tests by it, so
    one runs at a time (one CaptureService per process)."""
    records: Path = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    if request.param == "tokens":
        options = token_server_options(record_dir=records)
        upstream: Any = contextlib.nullcontext()
    else:
        kind = (
            ScriptedAnthropicUpstream if request.param == "messages" else ScriptedResponsesUpstream
        )
        upstream = kind()
    failures = _Failures()
    logging.getLogger().addHandler(failures)
    try:
        with upstream as mock:
            if mock is not None:
                options = ServerOptions(mock.base_url, record_dir=records)
            thread = ServerThread(options)
            thread.start()
            yield thread
            thread.stop()
    finally:
        logging.getLogger().removeHandler(failures)
    assert not failures.records, [r.getMessage() for r in failures.records]


class _Failures(logging.Handler):
    """The log records carrying a traceback (`logger.exception`) while the server ran."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


def _post(server: ServerThread, route: str, body: Any) -> httpx.Response:
    with Control(server.url) as control:
        created = control.create({"fuzz": route})
    base = created["anthropic_base_url"] + "/v1" if route == "messages" else created["base_url"]
    headers = {"x-api-key": created["api_key"], "authorization": f"Bearer {created['api_key']}"}
    return httpx.post(f"{base}/{route}", content=json.dumps(body), headers=headers, timeout=20)


def _check(response: httpx.Response, anthropic: bool) -> None:
    """A 200, or a 4xx whose body is the caller's error shape with a message."""
    assert response.status_code < 500, response.text
    assert "Traceback" not in response.text
    if response.status_code < 400:
        return
    body = response.json()
    if anthropic:
        assert body["type"] == "error", body
    error = body["error"]
    assert isinstance(error["type"], str) and error["message"], body


@pytest.mark.parametrize("server", ["messages", "tokens"], indirect=True)
@FUZZ
@given(body=ok(MESSAGES))
def test_fuzzed_messages_bodies(server: ServerThread, body: Any) -> None:
    _check(_post(server, "messages", body), anthropic=True)


@pytest.mark.parametrize("server", ["responses", "tokens"], indirect=True)
@FUZZ
@given(body=ok(RESPONSES))
def test_fuzzed_responses_bodies(server: ServerThread, body: Any) -> None:
    _check(_post(server, "responses", body), anthropic=False)

"""Through the proxy listener: Anthropic calls captured, other model-API routes refused."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import Control, ServerThread, proxy_confdir, run_harness

from skycap.mock.anthropic import ScriptedAnthropicUpstream
from skycap.mock.upstream import Reply
from skycap.server.options import ServerOptions

HARNESS = """
import json, anthropic
client = anthropic.Anthropic(api_key="sk-ant-harness-own", max_retries=0)  # api.anthropic.com
messages = [{"role": "user", "content": "go"}]
first = client.messages.create(model="claude-x", max_tokens=50, messages=messages)
messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
messages.append({"role": "user", "content": "again"})
with client.messages.stream(model="claude-x", max_tokens=50, messages=messages) as stream:
    second = stream.get_final_message()
counted = client.messages.count_tokens(model="claude-x", messages=messages)
try:
    client.beta.files.list()
    refused = None
except anthropic.APIStatusError as exc:
    refused = {"status": exc.status_code, "body": exc.body}
print(json.dumps({"first": first.content[0].text, "second": second.content[0].text,
                  "counted": counted.input_tokens, "refused": refused}))
"""


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedAnthropicUpstream]:
    with ScriptedAnthropicUpstream(lambda body: Reply(content="hello there")) as mock:
        yield mock


def serve(upstream: ScriptedAnthropicUpstream, confdir: Path, **options: Any) -> ServerThread:
    return ServerThread(
        ServerOptions(
            upstream.base_url, proxy_port=0, confdir=confdir, api_key="sk-upstream", **options
        )
    )


def test_claude_style_sdk_with_its_default_host_is_captured(
    upstream: ScriptedAnthropicUpstream, proxy_confdir: Path
) -> None:
    with serve(upstream, proxy_confdir) as server, Control(server.url) as control:
        created = control.create()
        before = len(upstream.requests)
        seen = run_harness(created, HARNESS, timeout=240)  # importing anthropic is slow
        assert seen["first"] == seen["second"] == "hello there" and seen["counted"] > 0
        assert seen["refused"]["status"] == 403
        error = seen["refused"]["body"]
        assert error["type"] == "error" and error["error"]["code"] == "route_not_captured"
        assert "api.anthropic.com/v1/files" in error["error"]["message"]
        forwarded = upstream.requests[before:]
        assert [r.path.partition("?")[0] for r in forwarded] == [
            "/v1/messages",
            "/v1/messages",
            "/v1/messages/count_tokens",
        ]
        for request in forwarded:  # the harness's own key never leaves skycap
            assert request.header("x-api-key") is None
            assert request.header("authorization") == "Bearer sk-upstream"
        health = control.http.get("/healthz").json()["proxy"]
        assert health["refused"] == {"api.anthropic.com": 1}
        finished = control.finish(created["id"]).json()
        assert finished["calls"] == 2 and len(finished["samples"]) == 1


def test_an_uncaptured_route_on_a_model_api_host_never_reaches_it(
    upstream: ScriptedAnthropicUpstream, proxy_confdir: Path
) -> None:
    root = upstream.base_url.removesuffix("/v1")
    with (
        serve(upstream, proxy_confdir, model_api_hosts=("127.0.0.*",)) as server,
        Control(server.url) as control,
    ):
        created = control.create()
        before = len(upstream.requests)
        with httpx.Client(proxy=created["proxy_url"], timeout=20) as plain:
            embeddings = plain.post(
                f"{root}/v1/embeddings",
                json={"input": "x"},
                headers={"authorization": "Bearer own"},
            )
            telemetry = plain.post(
                f"{root}/v1/traces/ingest", content=b"{}", headers={"anthropic-version": "1"}
            )
        assert len(upstream.requests) == before  # asserted on the wire: nothing arrived
        assert embeddings.status_code == 403
        assert embeddings.json()["error"]["code"] == "route_not_captured"
        assert "POST 127.0.0.1/v1/embeddings" in embeddings.json()["error"]["message"]
        assert telemetry.status_code == 403 and telemetry.json()["type"] == "error"
        assert control.http.get("/healthz").json()["proxy"]["refused"] == {"127.0.0.1": 2}
        finished = control.finish(created["id"]).json()
        assert finished["calls"] == 0 and finished["warnings"] == ["no model call was captured"]

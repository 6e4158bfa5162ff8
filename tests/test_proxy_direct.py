"""Text mode with a proxy and no upstream URL: proxied calls go to their original host."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import Control, ServerThread, control, proxy_confdir

from skycap.mock.upstream import ScriptedUpstream
from skycap.server.options import ServerOptions

BODY = {"model": "m", "messages": [{"role": "user", "content": "direct"}]}


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as mock:
        yield mock


@pytest.fixture(scope="module")
def server(proxy_confdir: Path) -> Iterator[ServerThread]:
    options = ServerOptions(
        proxy_port=0, confdir=proxy_confdir, api_key="sk-up", max_body_size=4096
    )
    with ServerThread(options) as server:
        yield server


def test_a_proxied_call_goes_to_its_original_host(
    control: Control, upstream: ScriptedUpstream
) -> None:
    created = control.create()
    origin = upstream.base_url.removesuffix("/v1")
    with httpx.Client(proxy=created["proxy_url"], timeout=20) as plain:
        reply = plain.post(
            f"{upstream.base_url}/chat/completions",
            json=BODY,
            headers={"authorization": "Bearer sk-harness"},
        )
        deployment = plain.post(
            f"{origin}/openai/deployments/gpt/chat/completions?api-version=1", json=BODY
        )
        models = plain.get(f"{upstream.base_url}/models")
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
    chat, deployed, listed = upstream.requests[-3:]
    assert chat.path == "/v1/chat/completions" and chat.header("host") == origin[7:]
    assert chat.header("authorization") == "Bearer sk-up"  # never the harness's own key
    # A deployment path is captured and forwarded as it was: this mock has no such
    # route, so the trajectory records the upstream's 404 as a failure.
    assert deployed.path == "/openai/deployments/gpt/chat/completions?api-version=1"
    assert deployment.status_code == 404
    assert models.status_code == 200 and listed.path == "/v1/models"
    document = control.document(created["id"]).json()
    assert sum(len(node["calls"]) for node in document["nodes"]) == 1
    assert [failure["status"] for failure in document["failures"]] == [404]


def test_a_base_url_call_needs_an_upstream_url(control: Control) -> None:
    created = control.create()
    answer = httpx.post(f"{created['base_url']}/chat/completions", json=BODY, timeout=20)
    assert answer.status_code == 502
    assert "no --upstream-url configured" in answer.json()["error"]["message"]
    assert control.http.get("/healthz").json()["capture"] == {"mode": "text"}


def test_limits_and_failures_inside_a_tls_tunnel(control: Control) -> None:
    created = control.create()
    trusted = ssl.create_default_context(cafile=created["env"]["SSL_CERT_FILE"])
    large = {"model": "m", "messages": [{"role": "user", "content": "x" * 8000}]}
    with httpx.Client(proxy=created["proxy_url"], verify=trusted, timeout=20) as client:
        oversize = client.post("https://api.openai.com/v1/chat/completions", json=large)
        unreachable = client.post("https://127.0.0.1:1/v1/chat/completions", json=BODY)
    assert oversize.status_code == 413  # answered by the drain sink through the tunnel
    assert "over the limit of 4096 bytes" in oversize.json()["error"]["message"]
    # The original host is down: 502 (mitmproxy's own page inside TLS) and a failure recorded.
    assert unreachable.status_code == 502
    failures = control.document(created["id"]).json()["failures"]
    assert len(failures) == 1 and failures[0]["error"].startswith("upstream: ")

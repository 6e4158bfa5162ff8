"""Text mode through the HTTPS_PROXY listener: capture by credentials, 407/410, pass-through."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import orjson
import pytest
from server_fixtures import (
    Control,
    ServerThread,
    basic,
    control,
    proxy_confdir,
    raw_connect,
    run_harness,
    wait_for,
)

from skycap.mock.upstream import Reply, ScriptedUpstream
from skycap.server.options import ServerOptions

LOOKUP = {"function": {"name": "lookup", "arguments": "{}"}}


def script(body: dict[str, Any]) -> Reply:
    """A tool call to the first turn, then an answer."""
    if body["messages"][-1]["role"] == "user" and body["messages"][-1]["content"] == "go":
        return Reply(tool_calls=[LOOKUP])
    return Reply(content="all done")


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(script) as mock:
        yield mock


@pytest.fixture(scope="module")
def server(
    upstream: ScriptedUpstream, proxy_confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    options = ServerOptions(
        upstream.base_url,
        proxy_port=0,
        confdir=proxy_confdir,
        record_dir=tmp_path_factory.mktemp("records"),
        api_key="sk-upstream",
        require_api_key=True,  # through the proxy, the proxy credentials are the key
        proxy_allow=[f"127.0.0.1:{urlsplit(upstream.base_url).port}"],  # the mock's pass-through
    )
    with ServerThread(options) as server:
        yield server


def proxy_port(server: ServerThread) -> int:
    port = server.server.proxy.port
    assert isinstance(port, int) and port > 0
    return port


def tls_client(proxy: str, bundle: str) -> httpx.Client:
    """An in-process client through the proxy that trusts the bundle a create handed out."""
    return httpx.Client(proxy=proxy, verify=ssl.create_default_context(cafile=bundle), timeout=20)


def test_create_hands_out_the_proxy_env(server: ServerThread, control: Control) -> None:
    created = control.create()
    port = proxy_port(server)
    proxy_url = f"http://{created['id']}:{created['api_key']}@127.0.0.1:{port}"
    assert created["proxy_url"] == proxy_url
    bundle = str(server.options.confdir / "skycap-ca-bundle.pem")
    assert created["env"] == {
        "HTTPS_PROXY": proxy_url,
        "SSL_CERT_FILE": bundle,
        "NODE_EXTRA_CA_CERTS": bundle,  # Node-based CLIs (Claude Code)
        "NODE_USE_ENV_PROXY": "1",
        "CODEX_CA_CERTIFICATE": bundle,
        "NO_PROXY": "127.0.0.1",
    }
    assert created["anthropic_base_url"] == created["base_url"].removesuffix("/v1")
    health = control.http.get("/healthz").json()
    assert health["proxy"]["port"] == port
    # The control listener is no proxy: CONNECT there is refused, never tunnelled.
    status, _, _ = raw_connect(int(server.url.rsplit(":", 1)[1]), None)
    assert status.startswith("HTTP/1.1 400")


def test_a_harness_subprocess_is_captured_end_to_end(
    server: ServerThread, control: Control, upstream: ScriptedUpstream
) -> None:
    created = control.create({"task": "proxy"})
    before = len(upstream.requests)
    seen = run_harness(created)  # calls https://api.openai.com/v1 with no internet
    assert seen["first"]["tool_calls"][0]["function"]["name"] == "lookup"
    assert seen["streamed"] == "all done" and seen["models"] == ["mock-model"]
    forwarded = upstream.requests[before:]
    assert [(r.method, r.path) for r in forwarded] == [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
    ]
    for request in forwarded:  # the harness's own key and the proxy key never leave skycap
        assert request.header("authorization") == "Bearer sk-upstream"
        assert request.header("proxy-authorization") is None
    assert orjson.loads(forwarded[1].body)["stream"] is True
    listing = {row["id"]: row for row in control.http.get("/trajectories").json()}
    assert listing[created["id"]]["calls"] == 2
    result = control.finish(created["id"], annotations={"reward": 1}).json()
    assert result["status"] == "finished"
    sample = max(result["samples"], key=lambda s: len(s["messages"]))
    assert [m["role"] for m in sample["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert sample["messages"][-1]["content"] == "all done"


@pytest.mark.parametrize(
    ("credentials", "message"),
    [
        (None, "proxy credentials are missing"),
        ("Bearer sk-skycap-x", "Proxy-Authorization must be Basic"),
        ("unknown", "unknown trajectory tr_0123456789abcdef"),
        ("wrong-key", "wrong api_key for trajectory"),
        ("other-key", "wrong api_key for trajectory"),
    ],
)
def test_connect_refusals_are_407(
    server: ServerThread, control: Control, credentials: str | None, message: str
) -> None:
    created, other = control.create(), control.create()
    header = {
        None: None,
        "unknown": basic("tr_0123456789abcdef", created["api_key"]),
        "wrong-key": basic(created["id"], "sk-skycap-guess"),
        "other-key": basic(created["id"], other["api_key"]),
    }.get(credentials, credentials)
    status, headers, body = raw_connect(proxy_port(server), header)
    assert status.startswith("HTTP/1.1 407 ") and message in status
    assert headers["proxy-authenticate"] == 'Basic realm="skycap"'
    assert message in orjson.loads(body)["error"]["message"]


def test_the_sdk_sees_why_its_proxy_refused(server: ServerThread, control: Control) -> None:
    created = control.create()
    wrong = f"http://{created['id']}:sk-skycap-guess@127.0.0.1:{proxy_port(server)}"
    http_client = tls_client(wrong, created["env"]["SSL_CERT_FILE"])
    with (
        openai.OpenAI(api_key="x", max_retries=0, http_client=http_client) as client,
        pytest.raises(openai.APIConnectionError) as refused,
    ):
        client.models.list()
    assert "407" in str(refused.value.__cause__) and "wrong api_key" in str(refused.value.__cause__)


def test_an_ended_trajectory_gets_410_inside_its_tunnel(
    server: ServerThread, control: Control, upstream: ScriptedUpstream
) -> None:
    created = control.create()
    assert control.finish(created["id"]).status_code == 200
    assert not server.run_in_loop(lambda: server.store.get(created["id"]))  # on disk only: no key
    status, _, _ = raw_connect(proxy_port(server), basic(created["id"], "any key"))
    assert status.startswith("HTTP/1.1 200")  # accepted, refused inside
    before = len(upstream.requests)
    http_client = tls_client(created["proxy_url"], created["env"]["SSL_CERT_FILE"])
    with (
        openai.OpenAI(api_key="x", max_retries=0, http_client=http_client) as client,
        pytest.raises(openai.APIStatusError) as closed,
    ):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert closed.value.status_code == 410 and closed.value.code == "trajectory_closed"
    with httpx.Client(proxy=created["proxy_url"]) as plain:
        passed = plain.get(upstream.base_url.replace("/v1", "/elsewhere"))
    assert passed.status_code == 410 and passed.json()["error"]["code"] == "trajectory_closed"
    assert len(upstream.requests) == before  # nothing reached the upstream


def test_other_traffic_passes_through_untouched_and_is_counted(
    server: ServerThread, control: Control, upstream: ScriptedUpstream
) -> None:
    created = control.create()
    counted = control.http.get("/healthz").json()["proxy"]["passed_through"].get("127.0.0.1", 0)
    root = upstream.base_url.removesuffix("/v1")
    with httpx.Client(proxy=created["proxy_url"], timeout=20) as plain:  # absolute form
        got = plain.get(f"{root}/files/1?x=2", headers={"authorization": "Bearer own"})
        posted = plain.post(f"{root}/v1/embeddings", content=b'{"input": "x"}')
        chat = plain.post(
            f"{root}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "plain"}]},
        )
    assert got.status_code == posted.status_code == 404  # the mock's own answers
    assert "mock upstream has no route" in got.json()["error"]["message"]
    files, embeddings, captured = upstream.requests[-3:]
    assert files.path == "/files/1?x=2" and files.header("authorization") == "Bearer own"
    assert files.header("proxy-authorization") is None
    assert embeddings.body == b'{"input": "x"}'
    assert chat.status_code == 200 and captured.header("authorization") == "Bearer sk-upstream"
    health = control.http.get("/healthz").json()
    assert health["proxy"]["passed_through"]["127.0.0.1"] == counted + 2
    document = control.document(created["id"]).json()
    assert sum(len(node["calls"]) for node in document["nodes"]) == 1  # only the chat call
    with httpx.Client(proxy=f"http://127.0.0.1:{proxy_port(server)}") as anonymous:
        refused = anonymous.get(f"{root}/files/1")
    assert refused.status_code == 407 and "proxy-authenticate" in refused.headers


def test_a_finish_while_the_tunnel_stays_open(
    server: ServerThread, control: Control, upstream: ScriptedUpstream
) -> None:
    created = control.create()
    body = {"model": "m", "messages": [{"role": "user", "content": "keep-alive"}]}
    with tls_client(created["proxy_url"], created["env"]["SSL_CERT_FILE"]) as client:
        url = "https://api.openai.com/v1/chat/completions"
        assert client.post(url, json=body).status_code == 200
        assert control.finish(created["id"]).status_code == 200
        late = client.post(url, json=body)  # same connection, same tunnel
        assert late.status_code == 410 and late.json()["error"]["code"] == "trajectory_closed"
        tunnels = server.run_in_loop(lambda: len(server.server.proxy._tunnels))

    def forgotten() -> bool:
        return server.run_in_loop(lambda: len(server.server.proxy._tunnels)) == tunnels - 1

    wait_for(forgotten, what="the closed connection's tunnel to be forgotten")

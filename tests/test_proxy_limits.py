"""The proxy's pass-through limits over real sockets: no relay into this machine."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from server_fixtures import Control, ServerThread, proxy_confdir, upstream

from skycap.mock.upstream import ScriptedUpstream
from skycap.server.destinations import Destinations, parse_rule, this_machine
from skycap.server.options import ServerOptions
from skycap.server.records import primary_address


def start(upstream: ScriptedUpstream, confdir: Path, **options) -> ServerThread:
    server = ServerThread(
        ServerOptions(upstream.base_url, proxy_port=0, confdir=confdir, **options)
    )
    server.start()
    return server


@pytest.fixture
def server(upstream: ScriptedUpstream, proxy_confdir: Path) -> Iterator[ServerThread]:
    server = start(upstream, proxy_confdir)
    yield server
    server.stop()


def proxied(server: ServerThread) -> tuple[dict, httpx.Client]:
    with Control(server.url) as control:
        created = control.create()
    return created, httpx.Client(proxy=created["proxy_url"], timeout=20)


def refused_code(response: httpx.Response) -> str | None:
    if response.status_code != 403:
        return None
    return response.json()["error"]["code"]


def test_loopback_and_link_local_are_refused_on_the_resolved_address(
    server: ServerThread, upstream: ScriptedUpstream
) -> None:
    port = urlsplit(upstream.base_url).port
    before = len(upstream.requests)
    created, client = proxied(server)
    with client:
        for url in (
            f"http://127.0.0.1:{port}/files",
            f"http://localhost:{port}/files",  # a name that resolves to loopback
            f"http://127.1.2.3:{port}/files",
            "http://169.254.169.254/latest/meta-data/",  # cloud metadata
            f"http://0.0.0.0:{port}/files",
        ):
            response = client.get(url)
            assert refused_code(response) == "destination_refused", (url, response.text)
            assert "--proxy-allow" in response.json()["error"]["message"]
    assert len(upstream.requests) == before  # nothing reached the loopback service
    with Control(server.url) as control:
        health = control.http.get("/healthz").json()["proxy"]
    assert health["refused"]["127.0.0.1"] == 1 and health["refused"]["169.254.169.254"] == 1
    assert health["passed_through"] == {}
    # Captured calls still go to the upstream on loopback: the limits are for pass-through.
    with httpx.Client(proxy=created["proxy_url"], timeout=20) as client:
        chat = client.post(
            "http://api.example.test/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "captured"}]},
        )
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]


def test_https_through_a_tunnel_to_loopback_is_refused(
    server: ServerThread, upstream: ScriptedUpstream
) -> None:
    created, _ = proxied(server)
    context = ssl.create_default_context(cafile=created["env"]["SSL_CERT_FILE"])
    port = urlsplit(upstream.base_url).port
    with httpx.Client(proxy=created["proxy_url"], verify=context, timeout=20) as client:
        response = client.get(f"https://127.0.0.1:{port}/secret")
    assert refused_code(response) == "destination_refused"


def test_a_raw_tcp_tunnel_to_loopback_is_closed(
    server: ServerThread, upstream: ScriptedUpstream
) -> None:
    created, _ = proxied(server)
    port = urlsplit(upstream.base_url).port
    before = len(upstream.requests)
    proxy = server.server.proxy.port
    credentials = httpx.URL(created["proxy_url"])
    basic = base64.b64encode(f"{credentials.username}:{credentials.password}".encode()).decode()
    with socket.create_connection(("127.0.0.1", proxy), timeout=10) as sock:
        sock.sendall(
            f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Proxy-Authorization: Basic {basic}\r\n\r\n".encode()
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"\x00\x01binary protocol, not HTTP\r\n")  # e.g. a database's wire
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
    assert received == b"" and len(upstream.requests) == before


def test_proxy_allow_widens_and_proxy_deny_wins(
    upstream: ScriptedUpstream, proxy_confdir: Path
) -> None:
    port = urlsplit(upstream.base_url).port
    server = start(
        upstream, proxy_confdir, proxy_allow=["127.0.0.0/8"], proxy_deny=[f"127.0.0.2:{port}"]
    )
    try:
        _, client = proxied(server)
        with client:
            allowed = client.get(f"http://127.0.0.1:{port}/files")
            denied = client.get(f"http://127.0.0.2:{port}/files")
    finally:
        server.stop()
    assert allowed.status_code == 404 and "mock upstream" in allowed.text  # reached the mock
    assert refused_code(denied) == "destination_refused"
    assert f"--proxy-deny 127.0.0.2:{port}" in denied.json()["error"]["message"]


def test_a_private_address_passes(server: ServerThread) -> None:
    address = primary_address()
    if this_machine(ipaddress.ip_address(address)):
        pytest.skip(f"this machine's primary address {address} is loopback")
    _, client = proxied(server)
    with client:
        # Nothing listens on the discard port: the connection fails, but it was attempted.
        response = client.get(f"http://{address}:9/")
    assert response.status_code == 502 and refused_code(response) is None


def test_rules_parse_and_judge() -> None:
    judge = Destinations([parse_rule("mirror.local:3128", "--proxy-allow")], [])
    refusal = asyncio.run(judge.refusal("127.0.0.1", 80))
    assert refusal is not None and "--proxy-allow 127.0.0.1:80" in refusal
    for private in ("10.1.2.3", "172.16.0.9", "192.168.1.1", "fd00::1", "8.8.8.8"):
        assert asyncio.run(judge.refusal(private, 443)) is None
    for local in ("fe80::1", "::1", "::ffff:127.0.0.1", "::", "169.254.1.1"):
        assert asyncio.run(judge.refusal(local, 22)) is not None, local
    assert parse_rule("[::1]:8080", "--proxy-allow").port == 8080
    assert parse_rule("*.internal", "--proxy-deny").matches("pkg.internal", 80, [])
    for bad in ("", "10.0.0.0/33", "host:0", "host:http", "[::1", "a..b"):
        with pytest.raises(ValueError, match="--proxy-allow"):
            parse_rule(bad, "--proxy-allow")
    with pytest.raises(ValueError, match="--proxy-allow '10.0.0.0/99'"):
        ServerOptions("http://127.0.0.1:9/v1", proxy_allow=["10.0.0.0/99"])

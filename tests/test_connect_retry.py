"""A connect that failed before anything was sent is retried; a request that went out never is."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from server_fixtures import Control, make_server, upstream

from skycap.mock.upstream import ScriptedUpstream
from skycap.tokens import client as engine_client
from skycap.tokens.client import EngineClient
from skycap.tokens.engine import EngineError, VLLMEngine

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def refusing() -> Iterator[socket.socket]:
    """A bound port that is not listening: every connect to it is refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock
    sock.close()


def chat(created: dict) -> httpx.Response:
    return httpx.post(f"{created['base_url']}/chat/completions", json=CHAT, timeout=20)


def test_a_refused_connect_is_retried_and_the_call_answered(
    make_server, upstream: ScriptedUpstream, refusing: socket.socket, monkeypatch
) -> None:
    """The first connect is refused (the upstream restarting); the retry finds it up."""
    refused_port = refusing.getsockname()[1]
    real = asyncio.open_connection
    attempts: list[int] = []

    async def first_refused(host: str, port: int, **kwargs):  # type: ignore[no-untyped-def]
        attempts.append(port)
        return await real(host, refused_port if len(attempts) == 1 else port, **kwargs)

    server = make_server()
    monkeypatch.setattr(asyncio, "open_connection", first_refused)
    with Control(server.url) as control:
        created = control.create()
        response = chat(created)
        assert response.status_code == 200, response.text
        assert len(attempts) == 2 and len(upstream.requests) == 1
        causes = control.http.get("/healthz").json()["failing_causes"]
        assert causes["upstream_connect"]["failures_total"] == 0


def test_an_upstream_that_keeps_refusing_is_a_502_after_three_tries(
    make_server, refusing: socket.socket
) -> None:
    port = refusing.getsockname()[1]
    server = make_server(upstream_url=f"http://127.0.0.1:{port}/v1")
    with Control(server.url) as control:
        created = control.create()
        response = chat(created)
        assert response.status_code == 502
        message = response.json()["error"]["message"]
        assert f"cannot connect to 127.0.0.1:{port}" in message and "(3 tries)" in message
        cause = control.http.get("/healthz").json()["failing_causes"]["upstream_connect"]
        assert cause["failing"] and cause["trajectories"] == 1 and cause["failures_total"] == 1


class ResetAfterRequest:
    """A server that reads one whole request, then resets the connection: the upstream may
    have acted on it, so it must not be sent again."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(line for line in head.split(b"\r\n") if b"ength:" in line).split()[1])
            while len(body) < length:
                body += conn.recv(65536)
            self.requests += 1
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # an RST, not a FIN


def test_a_reset_after_the_request_was_read_is_never_resent(make_server) -> None:
    upstream = ResetAfterRequest()
    server = make_server(upstream_url=f"http://127.0.0.1:{upstream.port}/v1")
    try:
        with Control(server.url) as control:
            created = control.create()
            response = chat(created)
            assert response.status_code == 502
            assert response.json()["error"]["message"].startswith("upstream unavailable")
            assert (upstream.accepted, upstream.requests) == (1, 1)
            cause = control.http.get("/healthz").json()["failing_causes"]["upstream_connect"]
            assert cause["failures_total"] == 0  # not a connect failure
    finally:
        upstream.sock.close()


class LateEngine:
    """An engine port that refuses until the client's first retry pause, then answers once."""

    def __init__(self, refusing: socket.socket) -> None:
        self.sock = refusing
        self.port = refusing.getsockname()[1]
        self.connections = 0

    async def pause(self, seconds: float) -> None:
        """The client's pause between connects: the engine comes up during the first."""
        if self.connections == 0 and not self.sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_ACCEPTCONN
        ):
            self.sock.listen()
            threading.Thread(target=self._answer, daemon=True).start()
        await asyncio.sleep(seconds)

    def _answer(self) -> None:
        conn, _ = self.sock.accept()
        self.connections += 1
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
        conn.close()


async def test_the_engine_client_retries_a_refused_connect(
    refusing: socket.socket, monkeypatch
) -> None:
    engine = LateEngine(refusing)
    monkeypatch.setattr(engine_client, "asyncio", SimpleNamespace(sleep=engine.pause))
    client = EngineClient(f"http://127.0.0.1:{engine.port}", None, VLLMEngine(), 10.0)
    try:
        assert await client.generate("tr_0123456789abcdef", b"{}") == (200, b"{}")
    finally:
        await client.close()
    assert engine.connections == 1
    assert client.unreachable.health()["failures_total"] == 0


async def test_an_engine_that_keeps_refusing_is_one_failure_after_three_tries(
    refusing: socket.socket, monkeypatch
) -> None:
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr(engine_client, "asyncio", SimpleNamespace(sleep=pause))
    port = refusing.getsockname()[1]
    client = EngineClient(f"http://127.0.0.1:{port}", None, VLLMEngine(), 10.0)
    try:
        with pytest.raises(EngineError, match="ConnectError"):
            await client.generate("tr_0123456789abcdef", b"{}")
    finally:
        await client.close()
    assert pauses == list(engine_client.CONNECT_RETRY_DELAYS)
    health = client.unreachable.health()
    assert health["failing"] and health["failures_total"] == 1

"""`Connection: close` from the harness is honoured on forwarded answers (issue 17 item 11)."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest
from server_fixtures import Control, make_server, upstream


def exchange(url: str, path: str, body: bytes | None, connection: str) -> tuple[str, bytes]:
    """One raw HTTP/1.1 request; (response head, what followed until the server closed)."""
    parts = urlsplit(url)
    method = "POST" if body is not None else "GET"
    head = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}", f"Connection: {connection}"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            return data.partition(b"\r\n\r\n")[0].decode("latin-1"), b"<still open>"
    response_head, _, rest = data.partition(b"\r\n\r\n")
    return response_head.decode("latin-1"), rest


@pytest.mark.parametrize("stream", [False, True])
def test_connection_close_closes_after_a_forwarded_chat(make_server, stream: bool) -> None:
    server = make_server()
    with Control(server.url) as control:
        created = control.create()
    path = urlsplit(created["base_url"]).path + "/chat/completions"
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "bye"}], "stream": stream}
    ).encode()
    head, rest = exchange(server.url, path, body, "close")
    assert head.startswith("HTTP/1.1 200")
    assert "connection: close" in head.lower()
    assert rest != b"<still open>" and (b"[DONE]" if stream else b"echo: bye") in rest
    with Control(server.url) as control:
        assert len(control.document(created["id"]).json()["nodes"]) == 2  # still captured


def test_a_forwarded_model_list_closes_too(make_server) -> None:
    server = make_server()
    with Control(server.url) as control:
        created = control.create()
    head, rest = exchange(server.url, urlsplit(created["base_url"]).path + "/models", None, "close")
    assert head.startswith("HTTP/1.1 200") and "connection: close" in head.lower()
    assert rest != b"<still open>"

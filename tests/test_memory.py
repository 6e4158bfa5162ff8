"""Memory after a large call (issue 17 item 10): its objects are freed without the collector."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import gc
import socket
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson
from mitmproxy.http import HTTPFlow
from server_fixtures import Control, make_server, upstream

from skycap.mock.upstream import ScriptedUpstream
from skycap.server.textmode import TextCall

MB = 1 << 20


def resident() -> int:
    """This process's resident set size in bytes (the server runs in it, on its thread)."""
    fields = Path("/proc/self/statm").read_text().split()
    return int(fields[1]) * 4096


def raw_post(url: str, body: bytes, token: str | None = None) -> bytes:
    """POST over a bare socket (an HTTP client would keep its request objects alive)."""
    parts = urlsplit(url)
    head = [f"POST {parts.path} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
    head += [f"Content-Length: {len(body)}", "Content-Type: application/json"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    with socket.create_connection((parts.hostname, parts.port), timeout=120) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        sock.sendall(body)
        chunks = []
        while chunk := sock.recv(1 << 20):
            chunks.append(chunk)
    response = b"".join(chunks)
    assert response.startswith(b"HTTP/1.1 200"), response[:300]
    return response.partition(b"\r\n\r\n")[2]


def large_objects(trajectory_id: str) -> list[object]:
    """Flows still holding the call's request, calls still holding a body, and any dict
    still holding the call's 200 MB string, alive without the collector (gc.get_objects
    sees what only cycles keep alive).
    """
    found: list[object] = []
    for obj in gc.get_objects():
        if isinstance(obj, HTTPFlow) and len(obj.request.raw_content or b"") > 100 * MB:
            found.append(obj)
        elif (
            isinstance(obj, TextCall)
            and obj.trajectory_id == trajectory_id
            and obj.request is not None
        ):
            found.append(obj)
        elif isinstance(obj, dict):
            try:  # the server thread may change a dict while we look at it
                items = tuple(obj.items())
            except RuntimeError:
                continue
            if any(isinstance(v, str | bytes) and len(v) > 100 * MB for _, v in items):
                found.append({k: type(v).__name__ for k, v in items})
    return found


def test_a_200_mb_call_is_freed_by_reference_counting(
    make_server, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    server = make_server(record_dir=tmp_path)
    token = server.control_token
    with Control(server.url) as control:
        created = control.create()
        messages = [
            {"role": "system", "content": "x" * (200 * MB)},
            {"role": "user", "content": "short question"},
        ]
        body = orjson.dumps({"model": "m", "messages": messages})
        del messages
        gc.collect()
        gc.disable()  # from here on only reference counting frees anything
        try:
            before = resident()
            reply = raw_post(created["base_url"] + "/chat/completions", body)
            del body
            assert b'"content":"echo: short question"' in reply
            upstream.requests.clear()  # the mock keeps what it received
            path = f"/trajectories/{created['id']}/finish"
            finished = raw_post(control.url + path, b'{"annotations": {"reward": 1}}', token)
            assert finished.startswith(b'{"id":')  # the samples carry the 200 MB message
            del finished, reply
            leftover = large_objects(created["id"])
            assert not leftover, f"alive without the collector: {leftover[:3]}"
            grown = resident() - before
        finally:
            gc.enable()
    # Loose: alone it grows about 200 MB (the finish answer, until the collector runs);
    # before the cycles were broken the request, its parse and the answer all stayed.
    assert grown < 500 * MB, f"resident memory grew by {grown / MB:.0f} MB after the call"

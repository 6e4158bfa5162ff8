"""The base-URL listener's own HTTP/1.1 loop: what it serves, what it hands to mitmproxy on
the same connection, and the parsing it does instead of mitmproxy's."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlsplit

import pytest
from server_fixtures import Control, make_server, upstream

from skycap.server.messages import request_head, response, response_head
from skycap.server.upstream import UpstreamError, read_chunked


def converse(url: str, data: bytes, responses: int) -> list[tuple[str, bytes]]:
    """Send raw bytes on one connection; read `responses` complete responses back."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        answers: list[tuple[str, bytes]] = []
        while len(answers) < responses:
            chunk = sock.recv(65536)
            assert chunk, f"the server closed after {len(answers)} responses: {received!r}"
            received += chunk
            while b"\r\n\r\n" in received:
                head, _, rest = received.partition(b"\r\n\r\n")
                if head.startswith(b"HTTP/1.1 100"):
                    answers.append((head.decode("latin-1"), b""))
                    received = rest
                    continue
                length = _content_length(head)
                if len(rest) < length:
                    break
                answers.append((head.decode("latin-1"), rest[:length]))
                received = rest[length:]
        return answers


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise AssertionError(f"no content-length in {head!r}")


def _chat(created: dict, path_tail: str = "/chat/completions") -> tuple[str, bytes]:
    path = urlsplit(created["base_url"]).path + path_tail
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    return path, body


def test_pipelined_requests_are_answered_in_order(make_server) -> None:
    server = make_server()
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    answers = converse(server.url, request * 3, 3)
    assert [head.split("\r\n")[0] for head, _ in answers] == ["HTTP/1.1 200 OK"] * 3


def test_a_chunked_call_body_is_read_and_recorded(make_server) -> None:
    server = make_server()
    with Control(server.url) as control:
        created = control.create()
        path, body = _chat(created)
        chunked = (
            b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:7], body[7:])) + b"0\r\n\r\n"
        )
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        head += "Content-Type: application/json\r\n\r\n"
        ((status, reply),) = converse(server.url, head.encode() + chunked, 1)
        assert status.startswith("HTTP/1.1 200"), status
        assert json.loads(reply)["choices"][0]["message"]["content"]
        nodes = control.document(created["id"]).json()["nodes"]
        assert [n["author"] for n in nodes] == ["client", "model"]


def test_expect_100_continue_goes_to_mitmproxy_and_is_answered(make_server) -> None:
    """curl sends `Expect: 100-continue` for large bodies: mitmproxy's own loop answers it."""
    server = make_server()
    with Control(server.url) as control:
        created = control.create()
    path, body = _chat(created)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    answers = converse(server.url, head.encode() + body, 2)
    assert answers[0][0].startswith("HTTP/1.1 100")
    assert answers[1][0].startswith("HTTP/1.1 200"), answers[1][0]


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n",  # another version
        b"GET http://x/healthz HTTP/1.1\r\nHost: x\r\n\r\n",  # absolute form
    ],
)
def test_what_this_loop_does_not_speak_is_answered_by_mitmproxy(make_server, raw: bytes) -> None:
    server = make_server()
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(raw)
        answer = sock.recv(65536)
    assert answer.startswith((b"HTTP/1.0 ", b"HTTP/1.1 ")), answer
    assert b"Traceback" not in answer


def test_a_malformed_head_gets_an_error_and_the_server_keeps_serving(make_server) -> None:
    server = make_server()
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    ((status, _),) = converse(server.url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 1)
    assert status.startswith("HTTP/1.1 200")


# -- the parsing that replaces mitmproxy's -----------------------------------------------------


def test_request_heads_this_loop_reads() -> None:
    request = request_head(b"POST /t/a/v1/chat/completions HTTP/1.1\r\nHost: x\r\nA: b \r\n\r\n")
    assert request is not None
    assert (request.method, request.path, request.http_version) == (
        "POST",
        "/t/a/v1/chat/completions",
        "HTTP/1.1",
    )
    assert request.headers["a"] == "b" and request.headers["host"] == "x"
    for head in (
        b"GET / HTTP/1.0\r\n\r\n",
        b"GET * HTTP/1.1\r\n\r\n",
        b"GET /a b HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n",
        b"GET / HTTP/1.1\r\nA: b\r\n\tfolded: c\r\n\r\n",
        b"GET / HTTP/1.1\r\nA : b\r\n\r\n",
        b"GET / HTTP/1.1\r\nA\t: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
        b"GET / HTTP/1.1\r\n: empty name\r\n\r\n",
        b"G(T / HTTP/1.1\r\n\r\n",
    ):
        assert request_head(head) is None, head


def test_response_heads_and_answers() -> None:
    head = response_head(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
    assert (head.status_code, head.reason, head.headers["content-type"]) == (
        200,
        "OK",
        "text/event-stream",
    )
    with pytest.raises(ValueError, match="bad response line"):
        response_head(b"HTTP/1.1 2xx OK\r\n\r\n")
    answer = response(404, b"{}", {"content-type": "application/json", "content-length": "9"})
    assert answer.headers.get_all("content-length") == ["2"]
    assert answer.content == b"{}" and answer.reason == "Not Found"


async def _dechunk(data: bytes, step: int) -> tuple[bytes, bytes, int]:
    reader = asyncio.StreamReader()
    for i in range(0, len(data), step):
        reader.feed_data(data[i : i + step])
    reader.feed_eof()

    async def direct(awaitable):
        return await awaitable

    pieces = [piece async for piece in read_chunked(reader, direct)]
    return b"".join(pieces), await reader.read(), len(pieces)


@pytest.mark.parametrize("extension", [b"", b";ext=1", b" ; ext=1"])
@pytest.mark.parametrize("step", [1, 2, 5, 1 << 16])
def test_a_chunked_body_is_read_at_any_split_and_what_follows_is_left(
    step: int, extension: bytes
) -> None:
    chunks = [b"data: one\n\n", b"x" * 300, b"\r\n\n"]
    body = b"".join(b"%x%s\r\n%s\r\n" % (len(c), extension, c) for c in chunks)
    for ending in (b"0\r\n\r\n", b"0\r\nx-trailer: 1\r\n\r\n"):
        data, rest, count = asyncio.run(_dechunk(body + ending + b"NEXT", step))
        assert data == b"".join(chunks) and rest == b"NEXT"
        if step == 1 << 16:
            assert count == 1  # one read's chunks are one piece


def test_a_chunked_body_that_breaks_off_says_so() -> None:
    with pytest.raises(UpstreamError, match="in the middle of the body"):
        asyncio.run(_dechunk(b"5\r\nhel", 2))
    with pytest.raises(ValueError):
        asyncio.run(_dechunk(b"zz\r\nhello\r\n0\r\n\r\n", 100))


def test_a_chunked_body_past_the_limit_is_refused_in_the_callers_shape(make_server) -> None:
    """A chunked body announces no length: it is read to its end but not kept, and the
    caller gets the 413 naming its whole size; the connection goes on."""
    server = make_server(max_body_size=1000)
    with Control(server.url) as control:
        created = control.create()
        path, _ = _chat(created)
        body = b'{"model": "m", "messages": [], "pad": "' + b"x" * 5000 + b'"}'
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 700]), body[i : i + 700])
                           for i in range(0, len(body), 700)) + b"0\r\n\r\n"  # fmt: skip
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        (refused, error), (status, _) = converse(server.url, head.encode() + chunked + health, 2)
        assert refused.startswith("HTTP/1.1 413"), refused
        message = json.loads(error)["error"]["message"]
        assert f"request body of {len(body)} bytes is over the limit of 1000" in message
        assert status.startswith("HTTP/1.1 200")
        assert control.document(created["id"]).json()["nodes"] == []


def test_a_chunk_size_line_without_end_is_refused_not_buffered() -> None:
    """A size line (or trailers) that never ends is malformed past the longest head skycap
    reads, as with a line reader's limit, instead of growing the buffer without bound."""
    with pytest.raises(ValueError, match="chunk-size line longer than"):
        asyncio.run(_dechunk(b"5" * (2 << 20), 1 << 16))
    with pytest.raises(ValueError, match="trailers longer than"):
        asyncio.run(_dechunk(b"0\r\nx-t: " + b"a" * (2 << 20), 1 << 16))

"""A new dialect is one object: a toy API registered in the route table, called for real.

docs/architecture.md's "Dialects" says which files a new dialect changes: its module
(and, if it streams, its writer) and `server/routes.py`'s `DIALECTS`. This toy is all of
it in one place: a tiny fake API (`POST /v1/toy/complete`, a prompt in, text out) added
to the route table, then called through a real token-mode server over a socket, streamed
and not, and recorded. Nothing else in the server learns its name.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from server_fixtures import Control, ServerThread

from skycap.dialects import Earlier, ReplyData, Request, Route, StreamError
from skycap.record.reader import read_document
from skycap.server import routes
from skycap.server.options import ServerOptions
from skycap.wire import BodyError


class ToyWriter:
    """The toy's stream: one `data:` event per delta, then the end."""

    def __init__(self, head: ReplyData) -> None:
        self.head = head

    def start(self) -> bytes:
        return b'data: {"id":"%s"}\n\n' % self.head.id.encode()

    def delta(self, part: str, text: str) -> bytes:
        return b"data: " + orjson.dumps({part: text}) + b"\n\n" if text else b""

    def reasoning_done(self, message: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        return b"", message

    def end(self, reply: ReplyData) -> bytes:
        return b"data: " + orjson.dumps({"stop": reply.finish_reason}) + b"\n\ndata: end\n\n"

    def error(self, status: int, message: str) -> bytes:
        return b"data: " + orjson.dumps({"toy_error": message}) + b"\n\n"

    def keepalive(self) -> bytes:
        return b": still here\n\n"


class ToyDialect:
    """Toy Completions: `{"model", "prompt", "stream"?}` in, `{"id", "text", "stop"}` out."""

    name = "toy"
    upstream_path = b"/toy/complete"
    weight_versions_request = None
    reply_id_key = None
    routes = (Route("toy", "POST", "toy/complete", "/v1/toy/complete"),)
    caller_header = "x-toy-version"
    api_host = None

    def read(self, body: Any) -> Request:
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise BodyError("`prompt` must be a string")
        messages = [{"role": "user", "content": body["prompt"]}]
        sampling = {"max_tokens": body["max_tokens"]} if "max_tokens" in body else {}
        stream = body.get("stream") is True
        return Request(body, messages, None, body.get("model"), sampling, stream)

    def reply_message(self, parsed: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
        return {"role": "assistant", "content": parsed["text"]}, parsed["stop"], None

    def assembler(self) -> Any:
        raise StreamError("the toy has no upstream stream")

    def issue(
        self,
        message: dict[str, Any],
        completion_ids: Sequence[int],
        reasoning_ids: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        return message

    def reply_id(self) -> str:
        return "toy-" + secrets.token_hex(6)

    def reply_json(self, reply: ReplyData) -> bytes:
        text = reply.message.get("content") or ""
        return orjson.dumps({"id": reply.id, "text": text, "stop": reply.finish_reason})

    def reply_sse(self, reply: ReplyData) -> bytes:
        writer = ToyWriter(reply)
        text = reply.message.get("content") or ""
        return writer.start() + writer.delta("content", text) + writer.end(reply)

    def error(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> bytes:
        return orjson.dumps({"toy_error": message, "status": status})

    def finish_reason(self, canonical: str) -> str:
        return canonical

    def stream_failure(self, assembler: Any, message: str) -> bytes:
        return self.error(502, message)

    def stream_writer(self, head: ReplyData, reasoning_keys: Sequence[str]) -> ToyWriter:
        return ToyWriter(head)

    def models_listing(self, status: int, body: bytes) -> bytes:
        names = [m["id"] for m in orjson.loads(body)["data"]] if status == 200 else []
        return orjson.dumps({"toy_models": names})

    def prepare(self, request: Request, earlier: Earlier, renders: bool) -> None:
        """Nothing to prepare."""


TOY = ToyDialect()


@pytest.fixture(scope="module")
def server(
    token_server_options: Callable[..., ServerOptions], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routes, "TABLE", routes.RouteTable((*routes.DIALECTS, TOY)))
        options = token_server_options(record_dir=tmp_path_factory.mktemp("records"))
        with ServerThread(options) as server:
            yield server


@pytest.fixture(scope="module")
def control(server: ServerThread) -> Iterator[Control]:
    with Control(server.url) as control:
        yield control


def test_a_toy_dialect_is_routed_answered_streamed_and_recorded(control: Control) -> None:
    trajectory = control.create()
    url = trajectory["base_url"] + "/toy/complete"
    key = {"authorization": f"Bearer {trajectory['api_key']}"}
    with httpx.Client(timeout=20, headers=key) as http:
        whole = http.post(url, json={"model": "p", "prompt": "find x", "max_tokens": 30})
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert answer["id"].startswith("toy-") and answer["text"] and answer["stop"]
        body = {"model": "p", "prompt": "find y", "max_tokens": 30, "stream": True}
        with http.stream("POST", url, json=body) as streamed:
            assert streamed.status_code == 200
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[0].startswith('data: {"id":"toy-') and events[-1] == "data: end"
        text = "".join(orjson.loads(e[6:]).get("content", "") for e in events[1:-1])
        assert text
        refused = http.post(url, json={"model": "p", "prompt": 7})
        assert refused.status_code == 400
        assert refused.json() == {"toy_error": "`prompt` must be a string", "status": 400}
        listing = http.get(trajectory["base_url"] + "/models", headers={"x-toy-version": "1"})
        assert listing.status_code == 200 and listing.json()["toy_models"]
    result = control.finish(trajectory["id"]).json()
    stored = read_document(Path(result["record"]["path"]))
    calls = [c for n in stored["nodes"] for c in n["calls"]]
    assert [c["dialect"] for c in calls] == ["toy", "toy"]
    replies = [n["message"]["content"] for n in stored["nodes"] if n["calls"]]
    assert replies == [answer["text"], text]

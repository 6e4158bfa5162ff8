"""A new engine wire is one module: a toy engine that speaks its own generate shape, chosen
with `--engine-wire`, serves a real token-mode server to the openai SDK (docs/tokens.md,
"Engines and renderers").

`ToyWire` below is the whole of the new wire: its request, its whole and streamed reply
shapes, its session header, abort route and model list. `ToyEngine` is the small scripted
server that speaks it, on a real socket.
"""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import argparse
import json
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler
from typing import Any

import openai
import orjson
import pytest
from server_fixtures import Control, ServerThread, control

from skycap.local_http import LocalHTTPServer
from skycap.server import flags
from skycap.server.options import ServerOptions
from skycap.tokens.engine import EngineError, EngineOutput, VLLMEngine, load_wire

START = [{"role": "user", "content": "Say hello."}]
REPLY = "Hello there. Bye."
SERVED = "toy-policy"


def toy_logprob(position: int) -> float:
    return -0.125 * (position + 1)


class ToyStream:
    """The toy's streamed reply: `{"rid", "out": [id], "lp": [x]}` chunks, `why` on the last."""

    def __init__(self, wire: ToyWire) -> None:
        self.wire = wire
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finished = False
        self.request_id: str | None = None
        self.why: str | None = None

    def feed(self, chunk: Any) -> list[int]:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("out"), list):
            raise EngineError(f"a toy chunk has no `out` list: {chunk!r:.200}")
        self.request_id = chunk.get("rid", self.request_id)
        self.token_ids += chunk["out"]
        self.logprobs += chunk["lp"]
        if chunk.get("why") is not None:
            self.why, self.finished = chunk["why"], True
        return chunk["out"]

    def finish(self, *, stopped: bool = False) -> EngineOutput:
        if not self.finished and not stopped:
            raise EngineError("the toy stream ended without `why`")
        why = "stop" if stopped else self.why
        return self.wire.parse({"out": self.token_ids, "lp": self.logprobs, "why": why})


class ToyWire:
    """An engine wire written from scratch (no VLLMEngine): the skycap.tokens.engine.EngineWire
    protocol for the toy engine's `/toy/complete`."""

    name = "toy"
    generate_path = "/toy/complete"
    models_path = "/toy/models"

    def request(
        self,
        *,
        prompt_ids: Sequence[int],
        sampling: Mapping[str, Any],
        model: str | None,
        cache_salt: str | None,
        sampling_mask: bool,
        routes_from: int = 0,
        features: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {"prompt": list(prompt_ids), "limit": sampling.get("max_tokens"), "name": model}

    def stream_request(self, body: Mapping[str, Any], request_id: str) -> dict[str, Any]:
        return {**body, "stream": request_id}

    def parse(self, body: Any, *, routes_from: int = 0) -> EngineOutput:
        if not isinstance(body, dict) or not body.get("out"):
            raise EngineError("the toy reply has no tokens")
        return EngineOutput(list(body["out"]), [float(x) for x in body["lp"]], body["why"])

    def stream_reader(self, routes_from: int) -> ToyStream:
        return ToyStream(self)

    def session_headers(self, session_id: str) -> dict[str, str]:
        return {"X-Toy-Session": session_id}

    def abort(self, request_id: str) -> tuple[str, dict[str, Any]]:
        return "/toy/cancel", {"rid": request_id}

    def release(self, session_id: str) -> None:
        return None

    def served_names(self, body: bytes) -> list[str]:
        return list(orjson.loads(body)["served"])


class ToyEngine:
    """The toy engine on 127.0.0.1: each completion is REPLY's tokens plus the stop token.

    A streamed reply sends one token per chunk and, before its last chunk, waits (up to
    `hold` seconds) for a cancel, so a stop string that skycap cuts finds it still running.
    """

    def __init__(self, tokenizer: Any, hold: float = 10.0) -> None:
        self.ids = tokenizer.encode(REPLY, add_special_tokens=False) + [
            tokenizer.convert_tokens_to_ids("<|im_end|>")
        ]
        self.hold = hold
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        self.cancelled = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                engine.requests.append((self.path, dict(self.headers), None))
                self._send(200, {"served": [SERVED]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                engine.requests.append((self.path, dict(self.headers), body))
                if self.path == "/toy/cancel":
                    engine.cancelled.set()
                    self._send(200, {})
                elif "stream" in body:
                    self._stream(body["stream"])
                else:
                    lp = [toy_logprob(i) for i in range(len(engine.ids))]
                    self._send(200, {"out": engine.ids, "lp": lp, "why": "stop"})

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, rid: str) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                last = len(engine.ids) - 1
                for i, token in enumerate(engine.ids):
                    if i == last:
                        engine.cancelled.wait(engine.hold)
                    chunk = {"rid": rid, "out": [token], "lp": [toy_logprob(i)]}
                    if i == last:
                        chunk["why"] = "stop"
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

        self.server = LocalHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def generated(self) -> list[tuple[str, dict[str, str], Any]]:
        return [r for r in self.requests if r[0] == "/toy/complete"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def toy(qwen3_tokenizer: Any) -> Iterator[ToyEngine]:
    engine = ToyEngine(qwen3_tokenizer)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(toy: ToyEngine, qwen3_renderer: Any) -> Iterator[ServerThread]:
    """A token-mode server whose wire is the one `--engine-wire` names (and the session's
    renderer, rather than another loaded from the tokenizer folder)."""
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    spec = vars(parser.parse_args(["--engine-wire", f"{__name__}:ToyWire"]))["engine_wire"]
    (wire_flag,) = [f for f in flags.FLAGS if f.flag == "--engine-wire"]
    wire = wire_flag.convert(spec)
    assert isinstance(wire, ToyWire)
    options = ServerOptions(toy.url, mode="tokens", renderer=qwen3_renderer, engine=wire)
    with ServerThread(options) as server:
        yield server


def test_a_toy_wire_serves_whole_and_streamed_calls(
    server: ServerThread, control: Control, toy: ToyEngine
) -> None:
    trajectory = control.create()
    client = openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )
    whole = client.chat.completions.create(model="p", messages=START)
    assert whole.choices[0].message.content == REPLY and whole.choices[0].finish_reason == "stop"
    # The toy's own request shape, header and served name (learned from its model list).
    path, headers, body = toy.generated()[-1]
    assert headers["X-Toy-Session"] == trajectory["id"] and body["name"] == SERVED
    assert set(body) == {"prompt", "limit", "name"} and body["prompt"]
    assert any(r[0] == "/toy/models" for r in toy.requests)

    messages = [*START, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "!"}]
    chunks = list(
        client.chat.completions.create(model="p", messages=messages, stream=True, stop=["Bye"])
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == "Hello there. " and toy.cancelled.is_set()
    rid = toy.generated()[-1][2]["stream"]
    assert ("/toy/cancel", {"rid": rid}) in [(r[0], r[2]) for r in toy.requests]

    document = control.document(trajectory["id"]).json()
    assert document["capture"]["engine"] == "toy"
    calls = [call for node in document["nodes"] for call in node.get("calls", ())]
    assert [c["model"] for c in calls] == [SERVED, SERVED]
    assert calls[1]["stop_string"] == "Bye" and calls[1]["finish_reason"] == "stop"
    sample = control.finish(trajectory["id"]).json()["samples"][0]
    sampled = [lp for lp, m in zip(sample["logprobs"], sample["loss_mask"], strict=True) if m]
    first = [toy_logprob(i) for i in range(len(toy.ids))]
    assert sampled[: len(first)] == first and not any(math.isnan(x) for x in sampled)


def test_the_wire_flag_names_vllm_or_an_importable_class() -> None:
    assert type(load_wire("vllm")) is VLLMEngine
    for spec, problem in [
        ("vllm2", "must be vllm or MODULE:CLASS"),
        ("no_such_module:Wire", "cannot import it"),
        (f"{__name__}:NoSuchWire", "cannot import it"),
        (f"{__name__}:ToyEngine", "cannot build it with no arguments"),
    ]:
        with pytest.raises(ValueError, match=problem) as refused:
            load_wire(spec)
        assert str(refused.value).startswith("--engine-wire") and spec in str(refused.value)

"""The scripted engine's HTTP side: a threading server that closes its own connections, and
the handler that routes each request to the engine and writes its answer or its stream.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from skycap.local_http import LocalHTTPServer
from skycap.mock.engine_wire import json_bytes
from skycap.mock.weight_clock import VersionSpans

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
MODELS_PATH = "/v1/models"


@dataclass(frozen=True)
class Request:
    """One request the engine received, as decoded JSON (None if the body was not JSON)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class StreamedReply:
    """A streamed generate answer: its chunks, and the stream fault to play, if any."""

    chunks: list[dict[str, Any]]
    fault: str | None
    #: Labels each chunk's tokens with the weight version current as it is sent; the
    #: finishing chunk carries the spans (None: a version of vLLM that reports none).
    versions: VersionSpans | None = None


class EngineCalls(Protocol):
    """What the handler asks of the engine it serves (`ScriptedEngine`)."""

    models: list[str]

    def record(self, request: Request) -> None:
        """Log a request as received."""

    def generate(self, body: Any) -> tuple[int, bytes | StreamedReply] | None:
        """A generate call's (status, JSON bytes or stream), or None to close the connection."""

    def abort(self, body: Any) -> tuple[int, bytes]:
        """An `abort_requests` call's (status, body)."""

    def weight_route(self, method: str, route: str, body: Any) -> tuple[int, bytes] | None:
        """A weight-version or `/version` route's (status, body), or None for another route."""

    def stream_wait(self, index: int) -> None:
        """Pause before chunk `index` of a stream, as the engine generates."""

    def is_aborted(self, request_id: str) -> bool:
        """Whether `abort_requests` named this streamed request."""

    def note_stream_finished(self) -> None:
        """Count a stream sent to its end."""


class EngineServer(LocalHTTPServer):
    """Tracks open connections so stop() can close keep-alive clients too."""

    engine: EngineCalls

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()

    def close_connections(self) -> None:
        with self.connections_lock:
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.connections.clear()


class EngineHandler(BaseHTTPRequestHandler):
    """One connection's requests: routed to the engine, answered as JSON or as SSE."""

    protocol_version = "HTTP/1.1"
    # Headers and body leave in one segment, without Nagle: no 40 ms delayed-ACK stalls.
    wbufsize = 1 << 16
    disable_nagle_algorithm = True
    server: EngineServer

    def setup(self) -> None:
        super().setup()
        with self.server.connections_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.connections_lock:
            self.server.connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests and the demo read `engine.requests` instead."""

    def do_GET(self) -> None:
        engine = self.server.engine
        engine.record(Request("GET", self.path, dict(self.headers.items()), None))
        routed = engine.weight_route("GET", self._route(), None)
        if routed is not None:
            self._send(*routed)
            return
        if self._route() != MODELS_PATH:
            self._no_route()
            return
        models = [{"id": m, "object": "model", "owned_by": "vllm"} for m in engine.models]
        self._send(200, json_bytes({"object": "list", "data": models}))

    def do_POST(self) -> None:
        engine = self.server.engine
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        engine.record(Request("POST", self.path, dict(self.headers.items()), body))
        route = self._route()
        if route == ABORT_PATH:
            self._send(*engine.abort(body))
            return
        routed = engine.weight_route("POST", route, body)
        if routed is not None:
            self._send(*routed)
            return
        if route != GENERATE_PATH:
            self._no_route()
            return
        answer = engine.generate(body)
        if answer is None:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by stop()
            return
        if isinstance(answer[1], StreamedReply):
            self._stream(answer[1])
            return
        self._send(*answer)

    def _stream(self, reply: StreamedReply) -> None:
        """Send the chunks as SSE, paced as the engine generates; stop after an abort."""
        engine = self.server.engine
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunks = reply.chunks
        request_id = chunks[0]["request_id"]
        try:
            for index, chunk in enumerate(chunks):
                if reply.fault == "stream_break" and index >= max(len(chunks) // 2, 1):
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                engine.stream_wait(index)
                aborted = engine.is_aborted(request_id)
                if aborted:  # v1 engine: an aborted request finishes with "abort"
                    end = {**chunk["choices"][0], "token_ids": [], "finish_reason": "abort"}
                    end["logprobs"] = {"content": []}
                    chunk = {**chunk, "choices": [end]}
                elif reply.fault == "stream_no_finish" and chunk["choices"]:
                    chunk["choices"][0]["finish_reason"] = None
                _label(reply.versions, chunk)
                self._chunk(b"data: " + json_bytes(chunk) + b"\n\n")
                if aborted:
                    break
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
            engine.note_stream_finished()
        except OSError:
            self.close_connection = True  # the client went away: vLLM aborts the request

    def _route(self) -> str:
        return self.path.split("?", 1)[0]

    def _no_route(self) -> None:
        self._send(404, json_bytes({"error": {"message": f"no route {self.path}"}}))

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _send(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _label(versions: VersionSpans | None, chunk: dict[str, Any]) -> None:
    """Label a chunk's tokens as they are sent; the finishing chunk gets the spans
    (token_in_token_out/protocol.py GenerateStreamChoiceBase: set on the final chunk only)."""
    if versions is None or not chunk["choices"]:
        return
    choice = chunk["choices"][0]
    versions.label(len(choice.get("token_ids") or ()))
    if choice.get("finish_reason") is not None:
        choice["weight_versions"] = versions.spans()

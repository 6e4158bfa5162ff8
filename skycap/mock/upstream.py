"""Scripted OpenAI-compatible server on a real socket, with faults, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import h11
import orjson

from skycap.dialects.chat import openai_error
from skycap.mock.chat_wire import completion_body, model_entry, sse_event, stream_events
from skycap.mock.h11_io import READ_SIZE, json_head, read_request, send_json, stream_head
from skycap.mock.replies import MODEL, Reply, ReplySpec, as_reply, echo_reply

Fault = Literal["status", "garbage", "no_choices", "hang", "break_stream", "sleep"]
FAULTS: tuple[str, ...] = get_args(Fault)
Script = Callable[[dict[str, Any]], ReplySpec] | Iterable[ReplySpec]


@dataclass(frozen=True)
class RecordedRequest:
    """A request exactly as received: header names lowercased, body bytes untouched."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        """The first value of header `name` (case-insensitive), or None."""
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)


@dataclass
class _Fault:
    kind: str
    remaining: int | None
    status: int
    body: bytes | None
    seconds: float


class _ScriptError(Exception):
    pass


class ScriptedUpstream:
    """A mock model server at `start()`'s base URL (127.0.0.1, a free port, its own thread).

    Routes: `POST /v1/chat/completions` and `GET /v1/models`; anything else is a 404.
    Answers come from `script`: a callable (parsed request body -> Reply or mapping), or an
    iterable of replies consumed one per call (a call past its end gets a 500 saying so);
    without a script, `echo_reply`. Every request is appended to `requests` as received.

    Faults (`fail_next`) apply to chat calls only, in the order queued:

    * `status`: answer HTTP `status` with `body` (default an OpenAI-shaped error);
    * `garbage`: 200 that is not JSON (streamed: SSE events whose payload is not JSON);
    * `no_choices`: 200 JSON without `choices` (streamed: chunks without choices, [DONE]);
    * `hang`: never answer; released when the client disconnects or on `stop()`;
    * `break_stream`: send about half of the answer, then close the socket (no final chunk);
    * `sleep`: wait `seconds`, then answer normally.
    """

    def __init__(self, script: Script | None = None, *, chunk_delay: float = 0.0) -> None:
        self.chunk_delay = chunk_delay
        self.requests: list[RecordedRequest] = []
        self.base_url: str | None = None
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._faults: collections.deque[_Fault] = collections.deque()
        self._script: Callable[[dict[str, Any]], ReplySpec] | collections.deque[ReplySpec] | None
        self.script = script
        self._served = 0
        self._calls = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    @property
    def script(self) -> Script | None:
        """The reply source; assigning an iterable starts a new queue."""
        return self._script

    @script.setter
    def script(self, script: Script | None) -> None:
        with self._lock:
            if script is None or callable(script):
                self._script = script
            else:
                self._script = collections.deque(script)
            self._served = 0

    def start(self) -> str:
        """Bind and serve; return the base URL including `/v1`."""
        if self._thread is not None:
            raise RuntimeError("this ScriptedUpstream is already running: stop() it first")
        ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(ready),), name="skycap-mock-upstream", daemon=True
        )
        self._thread.start()
        port = ready.result(timeout=10)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self.base_url

    def stop(self) -> None:
        """Close the listener and every connection, releasing hung and sleeping calls."""
        if self._thread is None:
            return
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=10)
        self._thread = None
        self._loop = None

    def __enter__(self) -> ScriptedUpstream:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def fail_next(
        self,
        kind: Fault,
        *,
        times: int | None = 1,
        status: int = 500,
        body: bytes | None = None,
        seconds: float = 1.0,
    ) -> None:
        """Queue a fault for the next `times` chat calls (None: every call until `clear_faults`)."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}: use one of {', '.join(FAULTS)}")
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 or None, got {times}")
        with self._lock:
            self._faults.append(_Fault(kind, times, status, body, seconds))

    def clear_faults(self) -> None:
        """Drop every queued fault."""
        with self._lock:
            self._faults.clear()

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> None:
        """Block until at least `count` requests have arrived (TimeoutError otherwise)."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self.requests) >= count, timeout):
                raise TimeoutError(
                    f"mock upstream got {len(self.requests)} requests, expected {count} "
                    f"within {timeout} s"
                )

    # Server side: everything below runs on the server thread's event loop.

    async def _serve(self, ready: concurrent.futures.Future[int]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        connections: set[asyncio.Task[None]] = set()

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            connections.add(task)
            try:
                await self._connection(reader, writer)
            except asyncio.CancelledError:
                pass  # stop() cancels connections; ending normally keeps asyncio from logging it
            finally:
                connections.discard(task)

        try:
            server = await asyncio.start_server(accept, "127.0.0.1", 0)
        except OSError as exc:
            ready.set_exception(exc)
            return
        ready.set_result(server.sockets[0].getsockname()[1])
        await self._stopping.wait()
        server.close()
        for task in list(connections):
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)
        await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                received = await read_request(conn, reader)
                if received is None:
                    return
                keep_open = await self._route(conn, reader, writer, self._record(*received))
                del received  # an idle kept-alive connection holds no request it answered
                if not keep_open or conn.our_state is not h11.DONE:
                    return
                if conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError):
            return
        finally:
            writer.close()

    def _record(self, head: h11.Request, body: bytes) -> RecordedRequest:
        request = RecordedRequest(
            method=head.method.decode("ascii"),
            path=head.target.decode("latin-1"),
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in head.headers],
            body=body,
        )
        with self._arrived:
            self.requests.append(request)
            self._arrived.notify_all()
        return request

    async def _route(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: RecordedRequest,
    ) -> bool:
        path = request.path.split("?", 1)[0]
        if request.method == "POST" and path == self.CALL_PATH:
            return await self._chat(conn, reader, writer, request.body)
        if request.method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [model_entry()]}
            await send_json(conn, writer, 200, orjson.dumps(models))
            return True
        other = self._other_route(request.method, path, request.body)
        if other is not None:
            await send_json(conn, writer, 200, other)
            return True
        message = f"mock upstream has no route {request.method} {path}"
        await send_json(conn, writer, 404, self._error_body(404, message))
        return True

    # The wire shapes of this API; a scripted server for another API overrides these.

    CALL_PATH = "/v1/chat/completions"
    ID_PREFIX = "chatcmpl-mock"

    def _other_route(self, method: str, path: str, body: bytes) -> bytes | None:
        """A JSON answer for a route beside the model call and model list, or None (404)."""
        return None

    def _error_body(self, status: int, message: str) -> bytes:
        return openai_error(status, message)

    def _reply_body(self, reply: Reply, *, model: str, reply_id: str, request_size: int) -> bytes:
        return completion_body(reply, model=model, reply_id=reply_id, request_size=request_size)

    def _reply_events(
        self, reply: Reply, *, model: str, reply_id: str, request_size: int, body: dict[str, Any]
    ) -> list[bytes]:
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        return stream_events(
            reply,
            model=model,
            reply_id=reply_id,
            request_size=request_size,
            include_usage=include_usage,
        )

    def _no_choices(self, stream: bool) -> list[bytes] | bytes:
        """A 200 with no reply in it: stream events, or a JSON body."""
        if stream:
            head = {"id": "chatcmpl-mock-nochoices", "object": "chat.completion.chunk"}
            return [sse_event(head), b"data: [DONE]\n\n"]
        head = {"id": "chatcmpl-mock-nochoices", "object": "chat.completion", "model": MODEL}
        return orjson.dumps(head)

    async def _chat(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        raw: bytes,
    ) -> bool:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            body = None
            detail = f"request body is not JSON: {exc}"
        else:
            detail = "request body must be a JSON object"
        stream = isinstance(body, dict) and body.get("stream") is True
        fault = self._take_fault()
        if fault is not None and fault.kind != "sleep":
            return await self._fault(conn, reader, writer, fault, stream)
        if fault is not None:
            await asyncio.sleep(fault.seconds)
        if not isinstance(body, dict):
            await send_json(conn, writer, 400, self._error_body(400, detail))
            return True
        try:
            reply = self._reported(self._next_reply(body), body)
        except _ScriptError as exc:
            await send_json(conn, writer, 500, self._error_body(500, str(exc)))
            return True
        model = body.get("model") if isinstance(body.get("model"), str) else MODEL
        with self._lock:
            self._calls += 1
            reply_id = f"{self.ID_PREFIX}{self._calls}"
        ids = {"model": model, "reply_id": reply_id, "request_size": len(raw)}
        if not stream:
            await send_json(conn, writer, 200, self._reply_body(reply, **ids))
            return True
        await self._send_stream(conn, writer, self._reply_events(reply, **ids, body=body))
        return True

    def _take_fault(self) -> _Fault | None:
        with self._lock:
            if not self._faults:
                return None
            fault = self._faults[0]
            if fault.remaining is not None:
                fault.remaining -= 1
                if fault.remaining == 0:
                    self._faults.popleft()
            return fault

    def _reported(self, reply: Reply, body: dict[str, Any]) -> Reply:
        """What the wire reports of `reply`: vLLM's Chat Completions carry its weight
        versions only when the request asked (chat_completion/serving.py sends
        `output.weight_versions if request.return_weight_versions else None`)."""
        if body.get("return_weight_versions") is True:
            return reply
        return replace(reply, weight_versions=None)

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        with self._lock:
            script = self._script
            if isinstance(script, collections.deque):
                if not script:
                    raise _ScriptError(
                        f"scripted upstream: the script ran out after {self._served} replies; "
                        "queue more replies or pass a callable"
                    )
                self._served += 1
                spec = script.popleft()
        try:
            if script is None:
                return echo_reply(body)
            if callable(script):
                spec = script(body)
            return as_reply(spec)
        except Exception as exc:
            raise _ScriptError(f"scripted upstream: the script failed: {exc!r}") from exc

    async def _send_stream(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, events: list[bytes]
    ) -> None:
        writer.write(conn.send(stream_head()))
        for event in events:
            writer.write(conn.send(h11.Data(data=event)))
            await writer.drain()
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()

    async def _fault(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        fault: _Fault,
        stream: bool,
    ) -> bool:
        """Answer a chat call with `fault`; return whether the connection stays usable."""
        if fault.kind == "status":
            message = f"scripted upstream fault: HTTP {fault.status}"
            body = fault.body if fault.body is not None else self._error_body(fault.status, message)
            await send_json(conn, writer, fault.status, body)
        elif fault.kind == "hang":
            while await reader.read(READ_SIZE):
                pass
            return False
        elif fault.kind == "break_stream":
            await self._break(conn, writer, stream)
            return False
        elif fault.kind == "garbage" and stream:
            await self._send_stream(conn, writer, [b"data: <html>not json</html>\n\n"] * 2)
        elif fault.kind == "garbage":
            await send_json(conn, writer, 200, b"<html>this is not JSON</html>")
        else:  # no_choices
            empty = self._no_choices(stream)
            if isinstance(empty, list):
                await self._send_stream(conn, writer, empty)
            else:
                await send_json(conn, writer, 200, empty)
        return True

    async def _break(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, stream: bool
    ) -> None:
        """Send about half of a normal answer (never its finish chunk), then drop the socket."""
        reply = Reply(content="this reply is cut off before it ends")
        ids = {"model": MODEL, "reply_id": f"{self.ID_PREFIX}-broken", "request_size": 0}
        if stream:
            events = self._reply_events(reply, **ids, body={})
            writer.write(conn.send(stream_head()))
            for event in events[: len(events) // 2]:
                writer.write(conn.send(h11.Data(data=event)))
        else:
            payload = self._reply_body(reply, **ids)
            writer.write(conn.send(json_head(200, len(payload))))
            writer.write(conn.send(h11.Data(data=payload[: len(payload) // 2])))
        writer.transport.set_write_buffer_limits(high=0)  # drain() now waits for a flush
        await writer.drain()
        writer.transport.abort()

"""Scripted OpenAI-compatible server on a real socket, with faults, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import h11
import orjson

from skycap.dialects.chat import openai_error

MODEL = "mock-model"
CREATED = 1_700_000_000
PIECE_CHARS = 8
READ_SIZE = 65536

Fault = Literal["status", "garbage", "no_choices", "hang", "break_stream", "sleep"]
FAULTS: tuple[str, ...] = get_args(Fault)


@dataclass(frozen=True)
class Reply:
    """One scripted answer. `tool_calls` use the OpenAI message shape; ids default to `call_<i>`.

    `finish_reason` defaults to `tool_calls` when there are tool calls, else `stop`;
    `usage` defaults to deterministic counts derived from the sizes of request and reply.
    """

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


ReplySpec = Reply | Mapping[str, Any]
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


def echo_reply(body: Mapping[str, Any]) -> Reply:
    """The default answer: `echo: ` + the last user message's text, deterministic and cheap."""
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            return Reply(content=f"echo: {_text_of(message.get('content'))}")
    return Reply(content="echo")


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _as_reply(spec: ReplySpec) -> Reply:
    if isinstance(spec, Reply):
        return spec
    if isinstance(spec, Mapping):
        return Reply(**spec)
    raise TypeError(f"a scripted reply must be a Reply or a mapping, got {type(spec).__name__}")


def _pieces(text: str) -> list[str]:
    return [text[i : i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)] or [""]


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
    calls = []
    for i, call in enumerate(reply.tool_calls or []):
        function = call.get("function") or {}
        calls.append(
            {
                "id": call.get("id") or f"call_{i}",
                "type": "function",
                "function": {
                    "name": function.get("name", ""),
                    "arguments": function.get("arguments", ""),
                },
            }
        )
    return calls


def _finish_reason(reply: Reply) -> str:
    return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")


def _usage(reply: Reply, request_size: int) -> dict[str, Any]:
    if reply.usage is not None:
        return reply.usage
    produced = len(reply.content or "") + len(reply.reasoning_content or "")
    produced += sum(len(c["function"]["arguments"]) for c in _tool_calls(reply))
    prompt, completion = request_size // 4, produced // 4 + 1
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _message(reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning_content is not None:
        message["reasoning_content"] = reply.reasoning_content
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply)
    return message


def completion_body(reply: Reply, *, model: str, reply_id: str, request_size: int) -> bytes:
    """The non-streamed `chat.completion` JSON for `reply`."""
    return orjson.dumps(
        {
            "id": reply_id,
            "object": "chat.completion",
            "created": CREATED,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": _message(reply),
                    "finish_reason": _finish_reason(reply),
                    "logprobs": None,
                }
            ],
            "usage": _usage(reply, request_size),
        }
    )


def stream_events(
    reply: Reply, *, model: str, reply_id: str, request_size: int, include_usage: bool
) -> list[bytes]:
    """The SSE events for `reply`, each a separate write: role, reasoning and content pieces,
    each tool call as id+name then argument pieces, finish, usage (only when the request
    set `stream_options.include_usage`, as OpenAI does), then `[DONE]`."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return _event(head | {"choices": [choice]})

    head = {"id": reply_id, "object": "chat.completion.chunk", "created": CREATED, "model": model}
    events = [chunk({"role": "assistant"})]
    if reply.reasoning_content:
        events += [chunk({"reasoning_content": p}) for p in _pieces(reply.reasoning_content)]
    if reply.content is not None:
        events += [chunk({"content": p}) for p in _pieces(reply.content)]
    for i, call in enumerate(_tool_calls(reply)):
        function = call["function"]
        opening = {"index": i, "id": call["id"], "type": "function"}
        opening["function"] = {"name": function["name"], "arguments": ""}
        events.append(chunk({"tool_calls": [opening]}))
        for piece in _pieces(function["arguments"]):
            events.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
    events.append(chunk({}, _finish_reason(reply)))
    if include_usage:
        events.append(_event(head | {"choices": [], "usage": _usage(reply, request_size)}))
    events.append(b"data: [DONE]\n\n")
    return events


def _event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


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
                received = await _read_request(conn, reader)
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
            models = {"object": "list", "data": [_model_entry()]}
            await _send_json(conn, writer, 200, orjson.dumps(models))
            return True
        other = self._other_route(request.method, path, request.body)
        if other is not None:
            await _send_json(conn, writer, 200, other)
            return True
        message = f"mock upstream has no route {request.method} {path}"
        await _send_json(conn, writer, 404, self._error_body(404, message))
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
            return [_event(head), b"data: [DONE]\n\n"]
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
            await _send_json(conn, writer, 400, self._error_body(400, detail))
            return True
        try:
            reply = self._next_reply(body)
        except _ScriptError as exc:
            await _send_json(conn, writer, 500, self._error_body(500, str(exc)))
            return True
        model = body.get("model") if isinstance(body.get("model"), str) else MODEL
        with self._lock:
            self._calls += 1
            reply_id = f"{self.ID_PREFIX}{self._calls}"
        ids = {"model": model, "reply_id": reply_id, "request_size": len(raw)}
        if not stream:
            await _send_json(conn, writer, 200, self._reply_body(reply, **ids))
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
            return _as_reply(spec)
        except Exception as exc:
            raise _ScriptError(f"scripted upstream: the script failed: {exc!r}") from exc

    async def _send_stream(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, events: list[bytes]
    ) -> None:
        writer.write(conn.send(_stream_head()))
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
            await _send_json(conn, writer, fault.status, body)
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
            await _send_json(conn, writer, 200, b"<html>this is not JSON</html>")
        else:  # no_choices
            empty = self._no_choices(stream)
            if isinstance(empty, list):
                await self._send_stream(conn, writer, empty)
            else:
                await _send_json(conn, writer, 200, empty)
        return True

    async def _break(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, stream: bool
    ) -> None:
        """Send about half of a normal answer (never its finish chunk), then drop the socket."""
        reply = Reply(content="this reply is cut off before it ends")
        ids = {"model": MODEL, "reply_id": f"{self.ID_PREFIX}-broken", "request_size": 0}
        if stream:
            events = self._reply_events(reply, **ids, body={})
            writer.write(conn.send(_stream_head()))
            for event in events[: len(events) // 2]:
                writer.write(conn.send(h11.Data(data=event)))
        else:
            payload = self._reply_body(reply, **ids)
            writer.write(conn.send(_json_head(200, len(payload))))
            writer.write(conn.send(h11.Data(data=payload[: len(payload) // 2])))
        writer.transport.set_write_buffer_limits(high=0)  # drain() now waits for a flush
        await writer.drain()
        writer.transport.abort()


def _model_entry() -> dict[str, Any]:
    return {"id": MODEL, "object": "model", "created": CREATED, "owned_by": "skycap-mock"}


async def _read_request(
    conn: h11.Connection, reader: asyncio.StreamReader
) -> tuple[h11.Request, bytes] | None:
    head: h11.Request | None = None
    body: list[bytes] = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(READ_SIZE))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            return head, b"".join(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None


def _json_head(status: int, length: int) -> h11.Response:
    headers = [("content-type", "application/json"), ("content-length", str(length))]
    return h11.Response(status_code=status, headers=headers)


def _stream_head() -> h11.Response:
    headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
    return h11.Response(status_code=200, headers=headers)


async def _send_json(
    conn: h11.Connection, writer: asyncio.StreamWriter, status: int, body: bytes
) -> None:
    writer.write(
        conn.send(_json_head(status, len(body)))
        + conn.send(h11.Data(data=body))
        + conn.send(h11.EndOfMessage())
    )
    await writer.drain()

"""The dialect layer: one module per harness API, each with the same small interface.

A dialect turns its API's wire shapes into skycap's canonical, Chat Completions shaped data
and back, so the graph, samples, records, text mode and token mode never see an API's own
spelling. Every dialect module exposes one `Dialect` instance, `DIALECT`, with:

- `name`: recorded on each call as `dialect` ("chat", "messages", "responses").
- `reply_id_key`: the call key the reply's id is recorded under (`response_id` for
  Responses, whose later calls name earlier replies by id), or None.
- `forced_tool_finish`: token mode's canonical finish reason for a reply that called the
  named tool the request's `tool_choice` forced (`stop` for Chat Completions, as OpenAI
  and vLLM answer; `tool_calls` for the others).
- `read(body) -> Request`: check a parsed request body and read it into canonical messages,
  tools and sampling plus the dialect's extras; raises `wire.BodyError` (a 400) on bad input.
  Canonicalisation happens here, so both modes hash the same canonical messages.
- `upstream_path`: where text mode forwards a call, after the upstream base URL.
- `weight_versions_request`: the JSON member text mode adds to a call's body, with
  `--upstream-weight-versions`, to ask a vLLM upstream for the weight versions that
  sampled the reply (Chat Completions: `"return_weight_versions":true`); None when vLLM
  reports them on this API unasked or not at all.
- `reply_message(parsed) -> (message, finish_reason, usage)`: a non-streamed upstream reply
  (text mode) in canonical form; raises `StreamError` naming what is missing.
- `assembler() -> Assembler`: an incremental reader of the upstream's SSE stream (text mode):
  `feed(chunk)`, `finish_seen` (the stream's last data is coming), `done`, `usage`, and
  `result() -> (message, finish_reason)`, which raises `StreamError`.
- `issue(message, completion_ids, reasoning_ids=None) -> message`: token mode's parsed
  reply with the opaque ids this dialect issues (tool call ids, thinking signatures); the
  result is stored and answered, so a replay maps back to the exact node. Reasoning
  signatures name `reasoning_ids` (the tokens through the end of the thinking, so a
  stream can send them when the thinking ends), or the whole completion.

Token mode's SSE written as a reply is generated is a `StreamWriter` (`stream_writer`).
- `reply_id() -> str`: a fresh id for a token-mode reply (`chatcmpl-…`, `msg_…`).
- `reply_json(reply: ReplyData) -> bytes` and `reply_sse(reply: ReplyData) -> bytes`: token
  mode's answer from plain data, as one JSON body or one buffered SSE body.
- `error(status, message, code=None, param=None) -> bytes`: the dialect's error body;
  `param` names the request field at fault where the API's error shape has a place for it.
- `finish_reason(canonical) -> str`: the dialect's spelling of a canonical finish reason.
- `routes`: the harness routes this API answers (`Route`: method, path tail after
  `/t/{id}/v1/`, the suffix matched through the proxy listener, what the route does); the
  server's route table is built from them, so a route is written once.
- `caller_header`, `api_host`: a request header its SDKs always send, and the API's own
  host, by which a route every API shares (the model list, an unknown path, a refusal
  through the proxy) answers in this API's error shape; None when it has neither.
- `stream_writer(head, reasoning_keys) -> StreamWriter`: token mode's SSE for one reply,
  written as it is generated (`head` holds its id, model, prompt size and request;
  `reasoning_keys` the reasoning keys a Chat Completions reply answers).
- `models_listing(status, body) -> bytes`: token mode's OpenAI-shaped model list in this
  API's shape, for a caller this dialect claims.
- `prepare(request, earlier, renders)`: what a call needs before it is de-duplicated and
  run, given the trajectory's earlier replies (`Earlier`); `renders` is whether skycap
  renders the prompt itself (token mode). Responses places a `previous_response_id` call
  after that response here; raises `UnknownReply` (a 404 naming `param`) or `BodyError`.

Finish reasons on the canonical side are Chat Completions': `stop`, `length`, `tool_calls`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from skycap.dialects.sse import StreamError

__all__ = [
    "Assembler",
    "Dialect",
    "Earlier",
    "ReplyData",
    "Request",
    "Route",
    "StreamError",
    "StreamWriter",
    "UnknownReply",
]

#: What a route does (`Route.action`): run a model call, count its prompt's tokens, list
#: the models, or answer a stored reply by id.
CALL, COUNT_TOKENS, MODELS, STORED_REPLY = ("call", "count_tokens", "models", "stored_reply")


@dataclass(frozen=True, slots=True)
class Route:
    """One harness route, written once.

    `kind` names it (routing, the access log); `tail` is its path after `/t/{id}/v1/`
    and `proxy` the path suffix it is matched by through the proxy listener. A `tail`
    ending in `/` is a prefix an id follows (`responses/{id}`); its `proxy` is then
    matched anywhere in the path. `websocket` marks a call route also taken as a
    WebSocket (a GET upgrade on the same path), each client message one call
    (`server/websocket.py`).
    """

    kind: str
    method: str
    tail: str
    proxy: str
    action: str = CALL
    websocket: bool = False

    @property
    def prefix(self) -> bool:
        return self.tail.endswith("/")

    @property
    def access_tail(self) -> str:
        """The path the access log shows after `/t/{id}/v1/`."""
        return self.tail + "{id}" if self.prefix else self.tail


class UnknownReply(LookupError):
    """A call names an earlier reply this trajectory did not answer (a 404 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Earlier(Protocol):
    """A trajectory's earlier replies, as a call that names one by id reads them."""

    @property
    def trajectory_id(self) -> str: ...

    def history(self, reply_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """(the messages through the reply recorded under `reply_id`, the call that
        recorded it), the newest such reply; None when there is none."""
        ...


@dataclass(slots=True)
class Request:
    """One model call read into canonical form.

    `body` is the parsed body as sent; `messages` and `tools` are canonical (chat-shaped),
    `sampling` holds the sampling values as sent under their chat names (format.md §4);
    `extras` carries what only token mode reads (`cache_salt`, `max_prompt_tokens`, and
    `token_tools` / `omitted_tools` when token mode renders fewer tools than were sent);
    `token_refusal`, when set, is why token mode cannot run the call (a 400 there; text
    mode forwards it all the same); a dialect may give it as `refusal`, a function worked
    out on first asking, as text mode never asks. `recorded` holds fields every call of
    this request records besides the common ones (Responses: `previous_response_id`,
    `instructions`).
    """

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[Any] | None
    model: Any
    sampling: dict[str, Any]
    stream: bool
    extras: dict[str, Any] = field(default_factory=dict)
    refusal: str | Callable[[], str | None] | None = None
    recorded: dict[str, Any] = field(default_factory=dict)

    @property
    def token_refusal(self) -> str | None:
        if callable(self.refusal):
            self.refusal = self.refusal()
        return self.refusal

    @token_refusal.setter
    def token_refusal(self, value: str | None) -> None:
        self.refusal = value


@dataclass(frozen=True, slots=True)
class ReplyData:
    """What a token-mode reply says, free of any API's shape: the writer's input.

    `request` is the call it answers (a writer that reads request options, such as Chat
    Completions' `stream_options.include_usage`, or echoes request fields, reads it there);
    `stop_sequence` is the stop string that ended the reply, if one did (its
    `finish_reason` is then `stop`); `reasoning_tokens` counts the completion's tokens
    through the end of its thinking.
    """

    id: str
    created: int
    model: str
    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    request: Request | None = None
    stop_sequence: str | None = None
    reasoning_tokens: int = 0


class Assembler(Protocol):
    """A text-mode upstream stream being read; see the module docstring."""

    @property
    def finish_seen(self) -> bool: ...

    @property
    def done(self) -> bool: ...

    @property
    def usage(self) -> dict[str, Any] | None: ...

    def feed(self, chunk: bytes) -> None: ...

    def result(self) -> tuple[dict[str, Any], str]: ...


class StreamWriter(Protocol):
    """A token-mode reply streamed as it is generated, in one dialect's SSE.

    `start()` opens the stream; `delta(part, text)` sends reasoning or content text
    (`part` is "reasoning" or "content"); `reasoning_done(message)` closes the thinking
    with the issued reasoning message and returns (bytes, the message to store, which
    may carry ids the writer streamed with); `end(reply)` sends the rest of the reply
    (tool calls, the finish) after the commit; `error(status, message)` ends a failed
    stream with the dialect's error event; `keepalive()` is sent after a silence.
    Joined, a successful stream is the same reply `reply_sse` writes.
    """

    def start(self) -> bytes: ...

    def delta(self, part: str, text: str) -> bytes: ...

    def reasoning_done(self, message: dict[str, Any]) -> tuple[bytes, dict[str, Any]]: ...

    def end(self, reply: ReplyData) -> bytes: ...

    def error(self, status: int, message: str) -> bytes: ...

    def keepalive(self) -> bytes: ...


class Dialect(Protocol):
    """One harness API; see the module docstring for what each member does."""

    name: str
    upstream_path: bytes
    weight_versions_request: bytes | None
    reply_id_key: str | None
    routes: tuple[Route, ...]
    caller_header: str | None
    api_host: str | None
    forced_tool_finish: str

    def read(self, body: Any) -> Request: ...

    def reply_message(self, parsed: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]: ...

    def assembler(self) -> Assembler: ...

    def issue(
        self,
        message: dict[str, Any],
        completion_ids: Sequence[int],
        reasoning_ids: Sequence[int] | None = None,
    ) -> dict[str, Any]: ...

    def reply_id(self) -> str: ...

    def reply_json(self, reply: ReplyData) -> bytes: ...

    def reply_sse(self, reply: ReplyData) -> bytes: ...

    def error(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> bytes: ...

    def finish_reason(self, canonical: str) -> str: ...

    def stream_failure(self, assembler: Any, message: str) -> bytes: ...

    def stream_writer(self, head: ReplyData, reasoning_keys: Sequence[str]) -> StreamWriter: ...

    def models_listing(self, status: int, body: bytes) -> bytes: ...

    def prepare(self, request: Request, earlier: Earlier, renders: bool) -> None: ...

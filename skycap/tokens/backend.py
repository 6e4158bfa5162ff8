"""The token-mode backend the server plugs in: plan, engine call, commit and reply (http.md §9).

The server routes and gates requests (http.md §3) and hands a call read by its dialect
(skycap.dialects) here; everything after that, including the per-trajectory turn lock,
happens in `call`, and the answer is written in the call's dialect. Renderer
work (plan, reply parsing, decoding) runs on the renderer pool's worker threads, never on
the event loop; the HTTP calls to the engine are skycap.tokens.client's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from skycap.dialects import Dialect, ReplyData, Request
from skycap.dialects.chat import DIALECT as CHAT
from skycap.dialects.chat import REASONING_FIELDS
from skycap.dialects.tool_choice import names_a_function
from skycap.dialects.writers import stream_writer
from skycap.hashing import model_key, tools_hash
from skycap.tokens.client import CONNECT_TIMEOUT, EngineClient, engine_status_message
from skycap.tokens.commit import CommitError, commit_turn
from skycap.tokens.engine import (
    EngineError,
    EngineOutput,
    VLLMEngine,
    merge_sampling,
)
from skycap.tokens.interned import turn_lists
from skycap.tokens.models import ServedModel
from skycap.tokens.plan import Plan, PlanError, TurnLists, plan_turn
from skycap.tokens.relay import Relay
from skycap.tokens.renderer import Renderer, RenderError, renderer_pool
from skycap.tokens.reply import answered_message, finish_reason, reply_message
from skycap.tokens.sampling import (
    SamplingError,
    check_mask_constraints,
    check_overrides,
    generation_folders,
    load_generation_config,
    stop_strings,
    validate_cache_salt,
    validate_sampling,
)
from skycap.tokens.stops import StopMatch, apply_stop, strip_stop
from skycap.tokens.streaming import (
    EngineRefused,
    ReplyStream,
    StreamedCompletion,
)
from skycap.trajectory import FAILED, Trajectory

logger = logging.getLogger(__name__)

ENGINE_ERROR_BODY_LIMIT = 2000
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
#: Options the server's options object carries for this backend (TokenBackend keywords).
OPTION_NAMES = (
    "upstream_url",
    "api_key",
    "tokenizer",
    "renderer",
    "renderer_name",
    "renderer_pool_size",
    "chat_template_kwargs",
    "engine",
    "model",
    "max_model_len",
    "sampling_overrides",
    "sampling_mask",
    "logprobs_mode",
    "use_raw_content",
    "keep_special_tokens",
    "generation_config",
    "reasoning_field",
    "upstream_timeout",
)
#: The flag a vLLM server needs for sampling masks (config/model.py `return_sampling_mask`).
MASK_FLAG = "--return-sampling-mask"


@dataclass(frozen=True, slots=True)
class Reply:
    """A complete answer for the harness; `replayable`: SDK retries may reuse it (http.md §5).

    `call` is the committed call's record when the turn committed (what /healthz counts).
    """

    status: int
    headers: dict[str, str]
    body: bytes
    replayable: bool = False
    call: dict[str, Any] | None = None


class _TurnFailed(Exception):
    """A turn that ends before the commit with this reply (refusal or engine failure)."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply


@dataclass
class _TrajectoryState:
    """Per-trajectory turn state, in memory only: the turn lock, the experts layout (D-18),
    the last committed turn's token lists for the next plan (D-27), and the replies a
    dialect with reply ids answered, for `GET …/v1/responses/{id}` (D-40)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    experts_shape: tuple[int, ...] | None = None
    last_turn: TurnLists | None = None
    replies: dict[str, bytes] = field(default_factory=dict)


class TokenBackend:
    """Token mode for one server: a renderer pool, the engine wire and an HTTP client."""

    def __init__(
        self,
        *,
        upstream_url: str,
        api_key: str | None = None,
        tokenizer: str | None = None,
        renderer: Renderer | None = None,
        renderer_name: str | None = None,
        renderer_pool_size: int = 8,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        engine: VLLMEngine | None = None,
        model: str | None = None,
        max_model_len: int | None = None,
        sampling_overrides: Mapping[str, Any] | None = None,
        sampling_mask: bool = False,
        logprobs_mode: str = "processed_logprobs",
        use_raw_content: bool = False,
        keep_special_tokens: bool = False,
        generation_config: str | None = None,
        reasoning_field: str = "both",
        upstream_timeout: float | None = None,
    ) -> None:
        if not upstream_url:
            raise ValueError(
                "token mode needs upstream_url: the engine root, e.g. http://engine:8000"
            )
        if sampling_overrides is not None and not isinstance(sampling_overrides, Mapping):
            raise ValueError(
                f"sampling_overrides must be a mapping, got {type(sampling_overrides).__name__}"
            )
        self.upstream_url = upstream_url.rstrip("/")
        self.engine = engine or VLLMEngine()
        self.client = EngineClient(self.upstream_url, api_key, self.engine, upstream_timeout)
        self.served = ServedModel(model or None)
        self.max_model_len = max_model_len
        if reasoning_field not in REASONING_FIELDS:
            raise ValueError(
                f"reasoning_field must be one of {', '.join(REASONING_FIELDS)}, "
                f"got {reasoning_field!r}"
            )
        self.reasoning_field = reasoning_field
        self.sampling_overrides = dict(sampling_overrides or {})
        self.sampling_mask = sampling_mask
        self.logprobs_mode = logprobs_mode
        self.use_raw_content = use_raw_content
        self.keep_special_tokens = keep_special_tokens
        check_overrides(self.sampling_overrides, sampling_mask)
        self.generation_defaults, self.generation_source = load_generation_config(
            generation_config, generation_folders(tokenizer)
        )
        self._pool = renderer_pool(
            tokenizer, renderer, renderer_name, chat_template_kwargs, renderer_pool_size
        )
        self._stop_token_ids = list(self._pool.primary.stop_token_ids)
        self._think_end: int | None = getattr(self._pool.primary, "think_end_id", None)
        self._states: dict[str, _TrajectoryState] = {}

    @classmethod
    def from_options(cls, options: Any) -> TokenBackend:
        """Build from the server's options object, reading the OPTION_NAMES attributes it has."""
        return cls(
            **{name: getattr(options, name) for name in OPTION_NAMES if hasattr(options, name)}
        )

    @property
    def capture(self) -> dict[str, Any]:
        """The `capture` object of every token-mode trajectory (format.md §6)."""
        return {
            "mode": "tokens",
            "engine": self.engine.name,
            "tokenizer": self._pool.primary.name,
            "logprobs_mode": self.logprobs_mode,
            "sampling_overrides": self.sampling_overrides,
            "use_raw_content": self.use_raw_content,
        }

    @property
    def model(self) -> str | None:
        """The served model name (`--model`, or learned from the engine), once known."""
        return self.served.name

    async def start(self) -> None:
        """Learn the served model name from the engine's `/v1/models` (D-41), briefly.

        Retries with backoff for a few seconds here; if the engine is not up yet, keeps
        retrying in the background, and the first call asks again.
        """
        await self.served.start(self._list_models)

    # -- a harness call -------------------------------------------------------------------

    async def call(
        self,
        trajectory: Trajectory,
        request: Request,
        dialect: Dialect,
        stream: ReplyStream | None = None,
        harness_present: Callable[[], bool] | None = None,
    ) -> Reply:
        """Run one turn for a call read by `dialect` (http.md §9.2); always returns a Reply.

        With `stream` (a streamed call), the reply is written there as it is generated once
        nothing can refuse the call; a failure after that ends it with the dialect's error
        event. The Reply returned is then the whole stream, for retries to replay.
        `harness_present`, asked at the commit, says whether the harness is still there to
        receive the reply's end; a call committed without it is marked (D-52).
        """
        state = self._states.setdefault(trajectory.id, _TrajectoryState())
        async with state.lock:
            if not trajectory.is_open:
                return _error(
                    dialect, 410, f"trajectory is {trajectory.status}", "trajectory_closed"
                )
            if request.token_refusal is not None:
                return _error(dialect, 400, request.token_refusal)
            relay = Relay(stream) if stream is not None and request.stream else None
            try:
                return await self._turn(trajectory, request, dialect, state, relay, harness_present)
            except _TurnFailed as failed:
                if relay is not None:
                    relay.fail(failed.reply.status, failed.reply.body)
                return failed.reply
            except BaseException as exc:  # cancelled (the trajectory closed) or a bug
                if relay is not None:
                    cancelled = isinstance(exc, asyncio.CancelledError)
                    status, message = (
                        (410, "the trajectory was closed while this call ran")
                        if cancelled
                        else (500, f"token mode failed: {type(exc).__name__}: {exc}")
                    )
                    relay.fail(status, dialect.error(status, message))
                raise

    async def _turn(
        self,
        trajectory: Trajectory,
        request: Request,
        dialect: Dialect,
        state: _TrajectoryState,
        relay: Relay | None,
        harness_present: Callable[[], bool] | None,
    ) -> Reply:
        t_start = time.time()
        # A dialect whose tools a template cannot all express renders fewer (D-29).
        tools = request.extras["token_tools"] if "token_tools" in request.extras else request.tools
        served = await self.served.on_call(self._list_models)
        model = served or model_key(request.model)
        plan = await self._plan(
            trajectory, request.messages, tools, model, state.last_turn, dialect
        )
        room = self._check_limits(trajectory, request, len(plan.prompt_ids), dialect)
        sampling, engine_request = self._engine_request(request, plan, room, served, dialect)
        reply_id = dialect.reply_id()
        answered_model = self._answered_model(request)
        streamed: StreamedCompletion | None = None
        if relay is not None:
            head = ReplyData(
                reply_id, int(time.time()), answered_model, {}, "", len(plan.prompt_ids), 0, request
            )
            relay.open(stream_writer(dialect, head, self._reasoning_keys()))
            streamed = await self._stream(
                trajectory, request, dialect, plan, tools, sampling, engine_request, relay
            )
        if streamed is None:
            output = await self._generate(trajectory, engine_request, plan.routes_from, dialect)
            self._check_mask(trajectory, output, dialect)
            stop = await self._apply_stop(output, sampling, plan)
        else:
            output, stop = streamed.output, streamed.stop
            self._check_mask(trajectory, output, dialect)
        stored = await self._reply_message(trajectory, plan, output, tools, stop, dialect)
        think = _reasoning_tokens(output.completion_ids, self._think_end)
        reasoning_ids = output.completion_ids[:think] if think else None
        stored = dialect.issue(stored, output.completion_ids, reasoning_ids)
        if streamed is not None and relay is not None:
            stored = relay.finish_parts(stored, streamed.reasoning)
        reason = "stop" if stop else finish_reason(output.finish_reason, stored)
        forced = names_a_function(request.extras.get("tool_choice"))
        if reason == "tool_calls" and forced and dialect.name == "chat":
            reason = "stop"  # OpenAI and vLLM answer a forced named tool with "stop"
        requested = request.model if isinstance(request.model, str) else None
        call = {
            "t_start": t_start,
            "t_end": time.time(),
            "model": served or requested,
            "sampling": {k: v for k, v in sampling.items() if k != "stop_token_ids"},
            "usage": {
                "prompt_tokens": len(plan.prompt_ids),
                "completion_tokens": len(output.completion_ids),
            },
            "finish_reason": reason,
            "dialect": dialect.name,
            **_call_extras(output, stop),
            **request.recorded,
        }
        if request.extras.get("omitted_tools"):
            call["omitted_tools"] = request.extras["omitted_tools"]
        if dialect.reply_id_key is not None:
            call[dialect.reply_id_key] = reply_id
        if harness_present is not None and not harness_present():
            call["harness_saw_end"] = False  # D-52: committed after the harness went away
        status = self._commit(trajectory, plan, output, stored, call, tools, model, state, dialect)
        answered = answered_message(
            stored, use_raw_content=self.use_raw_content, reasoning_field=self.reasoning_field
        )
        data = ReplyData(
            id=reply_id,
            created=int(time.time()),
            model=answered_model,
            message=answered,
            finish_reason=reason,
            prompt_tokens=len(plan.prompt_ids),
            completion_tokens=len(output.completion_ids),
            request=request,
            stop_sequence=None if stop is None else stop.stop,
            reasoning_tokens=_reasoning_tokens(output.completion_ids, self._think_end),
        )
        if status == "ok" and dialect.reply_id_key is not None:
            state.replies[reply_id] = dialect.reply_json(data)  # GET …/{reply id} (D-40)
        reply = self._answer(request, dialect, data, status)
        committed = call if status == "ok" else None
        if relay is not None:
            relay.end(data, reply.body if streamed is None else None)
        return Reply(reply.status, reply.headers, reply.body, reply.replayable, committed)

    def _reasoning_keys(self) -> tuple[str, ...]:
        """The reasoning keys a Chat Completions reply answers (`--reasoning-field`)."""
        if self.use_raw_content:
            return ()
        if self.reasoning_field == "both":
            return ("reasoning_content", "reasoning")
        return (self.reasoning_field,)

    async def _stream(
        self,
        trajectory: Trajectory,
        request: Request,
        dialect: Dialect,
        plan: Plan,
        tools: list[Any] | None,
        sampling: Mapping[str, Any],
        engine_request: dict[str, Any],
        relay: Relay,
    ) -> StreamedCompletion | None:
        """Generate with the engine's stream, relaying deltas; None when the wire declines."""
        try:
            return await relay.generate(
                self.client,
                self._pool,
                session_id=trajectory.id,
                engine_request=engine_request,
                plan=plan,
                tools=tools,
                dialect=dialect,
                stops=stop_strings(sampling),
                min_tokens=sampling.get("min_tokens") or 0,
                raw=self.use_raw_content,
                skip_special_tokens=not self.keep_special_tokens,
                think_end=self._think_end,
                stop_token_ids=self._stop_token_ids,
            )
        except EngineRefused as refused:
            text = refused.body[:ENGINE_ERROR_BODY_LIMIT].decode("utf-8", "replace")
            trajectory.add_failure(refused.status, text)
            status = refused.status if refused.status >= 500 else 502
            raise _TurnFailed(
                _error(dialect, status, engine_status_message(refused.status, text))
            ) from None
        except (EngineError, RenderError) as exc:
            problem = f"engine: {exc}"
            trajectory.add_failure(None, problem)
            raise _TurnFailed(_error(dialect, 502, problem)) from exc

    def _check_mask(self, trajectory: Trajectory, output: EngineOutput, dialect: Dialect) -> None:
        """With `--sampling-mask`, a reply without masks means the engine lacks the flag."""
        if self.sampling_mask and output.sampling_mask is None:
            problem = (
                "engine: sampling masks were asked for (--sampling-mask) but the engine "
                f"returned none; start vLLM (0.33 or later) with {MASK_FLAG}, or drop "
                "--sampling-mask"
            )
            trajectory.add_failure(None, problem)
            raise _TurnFailed(_error(dialect, 502, problem))

    async def _apply_stop(
        self, output: EngineOutput, sampling: Mapping[str, Any], plan: Plan
    ) -> StopMatch | None:
        """Cut the completion at the first stop string (D-41), in place; the match or None.

        Every dialect's stop strings arrive as the canonical `stop` (Chat Completions
        `stop`, Anthropic `stop_sequences`).
        """
        stops = stop_strings(sampling)
        if not stops:
            return None
        min_tokens = sampling.get("min_tokens") or 0
        return await self._pool.run(
            lambda r: apply_stop(
                r,
                output,
                stops,
                plan.prompt_ids,
                min_tokens=min_tokens,
                skip_special_tokens=not self.keep_special_tokens,
            )
        )

    def _engine_request(
        self, request: Request, plan: Plan, room: int | None, model: str | None, dialect: Dialect
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(effective sampling, engine request body) (http.md §9.3-9.4).

        The model's generation defaults fill what the caller left out, then the overrides
        win (D-41). What vLLM would refuse answers 400 naming the field.
        """
        caller = dict(request.sampling)
        if "max_completion_tokens" in caller:
            caller["max_tokens"] = caller.pop("max_completion_tokens")
        cache_salt = request.extras.get("cache_salt")
        try:
            validate_cache_salt(cache_salt)
            sampling = merge_sampling(
                {**self.generation_defaults, **caller},
                self.sampling_overrides,
                room=room,
                stop_token_ids=self._stop_token_ids,
            )
            validate_sampling(sampling)
            if self.sampling_mask:
                check_mask_constraints(sampling, "this request")
            engine_request = self.engine.request(
                prompt_ids=plan.prompt_ids,
                sampling=sampling,
                model=model,
                cache_salt=cache_salt,
                sampling_mask=self.sampling_mask,
                routes_from=plan.routes_from,
            )
        except SamplingError as exc:
            raise _TurnFailed(_error(dialect, 400, str(exc), param=exc.param)) from exc
        except ValueError as exc:
            raise _TurnFailed(_error(dialect, 400, str(exc))) from exc
        return sampling, engine_request

    async def _reply_message(
        self,
        trajectory: Trajectory,
        plan: Plan,
        output: EngineOutput,
        tools: list[Any] | None,
        stop: StopMatch | None,
        dialect: Dialect,
    ) -> dict[str, Any]:
        """The reply message to store; a completion the renderer cannot read is a 502.

        After a stop string it is the message without it (what the harness will echo).
        """
        try:
            stored = await self._pool.run(
                lambda r: reply_message(
                    r,
                    output.completion_ids,
                    tools,
                    plan.prompt_ids,
                    use_raw_content=self.use_raw_content,
                    skip_special_tokens=not self.keep_special_tokens,
                )
            )
        except RenderError as exc:
            trajectory.add_failure(None, f"engine: {exc}")
            raise _TurnFailed(_error(dialect, 502, f"engine: {exc}")) from exc
        return stored if stop is None else strip_stop(stored, stop)

    async def _plan(
        self,
        trajectory: Trajectory,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        model: str,
        last_turn: TurnLists | None,
        dialect: Dialect,
    ) -> Plan:
        key = tools_hash(tools)
        try:
            return await self._pool.run(
                lambda r: plan_turn(trajectory.graph, r, messages, tools, key, model, last_turn)
            )
        except PlanError as exc:
            raise _TurnFailed(_error(dialect, 400, str(exc))) from exc

    def _check_limits(
        self, trajectory: Trajectory, request: Request, prompt_tokens: int, dialect: Dialect
    ) -> int | None:
        """Refusals before inference (http.md §9.2 steps 3-4); returns the room left, if bounded."""
        bound = request.extras.get("max_prompt_tokens")
        if bound is not None:
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
                message = f"max_prompt_tokens must be a non-negative integer, got {bound!r}"
                raise _TurnFailed(_error(dialect, 400, message))
            if prompt_tokens > bound:
                raise _too_long(
                    trajectory,
                    dialect,
                    f"prompt of {prompt_tokens} tokens exceeds max_prompt_tokens={bound}",
                )
        if self.max_model_len is None:
            return None
        room = self.max_model_len - prompt_tokens
        if room <= 0:
            raise _too_long(
                trajectory,
                dialect,
                f"prompt of {prompt_tokens} tokens leaves no room within "
                f"max_model_len={self.max_model_len}",
            )
        return room

    async def _generate(
        self, trajectory: Trajectory, request: dict[str, Any], routes_from: int, dialect: Dialect
    ) -> EngineOutput:
        """Call the engine and read its reply; failures are recorded and answered 502/5xx (D-14)."""
        try:
            status, content = await self.client.generate(trajectory.id, orjson.dumps(request))
            if status != 200:
                text = content[:ENGINE_ERROR_BODY_LIMIT].decode("utf-8", "replace")
                trajectory.add_failure(status, text)
                reply = _error(
                    dialect, status if status >= 500 else 502, engine_status_message(status, text)
                )
                raise _TurnFailed(reply)
            try:
                data = orjson.loads(content)
            except orjson.JSONDecodeError as exc:
                raise EngineError(f"the reply is not JSON: {exc}") from exc
            return self.engine.parse(data, routes_from=routes_from)
        except EngineError as exc:
            problem = f"engine: {exc}"
            trajectory.add_failure(None, problem)
            raise _TurnFailed(_error(dialect, 502, problem)) from exc

    def _commit(
        self,
        trajectory: Trajectory,
        plan: Plan,
        output: EngineOutput,
        stored: dict[str, Any],
        call: dict[str, Any],
        tools: list[Any] | None,
        model: str,
        state: _TrajectoryState,
        dialect: Dialect,
    ) -> str:
        """Commit on the event loop; a CommitError seals the trajectory `failed` (graph.md §8)."""
        try:
            node = commit_turn(
                trajectory,
                plan,
                output,
                stored,
                call,
                tools=tools,
                model=model,
                experts_shape=state.experts_shape,
            )
        except CommitError as exc:
            trajectory.add_failure(None, f"token attribution: {exc}")
            trajectory.seal(FAILED)
            return "failed"
        if node is None:
            raise _TurnFailed(
                _error(dialect, 410, f"trajectory is {trajectory.status}", "trajectory_closed")
            )
        if output.routed_experts is not None and state.experts_shape is None:
            state.experts_shape = tuple(output.routed_experts.shape[1:])
        state.last_turn = turn_lists(trajectory.graph, node.id, plan, output, state.last_turn)
        return "ok"

    def _answered_model(self, request: Request) -> str:
        requested = request.model
        return requested if isinstance(requested, str) and requested else self.model or ""

    def _answer(self, request: Request, dialect: Dialect, data: ReplyData, status: str) -> Reply:
        headers = {"x-skycap-status": status}
        if request.stream:
            headers |= {"content-type": "text/event-stream", "cache-control": "no-cache"}
            payload = dialect.reply_sse(data)
        else:
            headers["content-type"] = "application/json"
            payload = dialect.reply_json(data)
        return Reply(200, headers, payload, replayable=status == "ok")

    def stored_reply(self, trajectory_id: str, reply_id: str) -> bytes | None:
        """A reply this trajectory was answered, by id (`GET …/v1/responses/{id}`), or None."""
        state = self._states.get(trajectory_id)
        return None if state is None else state.replies.get(reply_id)

    # -- other routes and lifecycle -------------------------------------------------------

    async def count_tokens(self, request: Request, dialect: Dialect) -> int | Reply:
        """The rendered prompt's length for `request` (Messages `count_tokens`), or a 400."""
        try:
            rendered = await self._pool.run(lambda r: r.render(request.messages, request.tools))
        except RenderError as exc:
            return _error(dialect, 400, str(exc))
        return len(rendered.token_ids)

    async def models(self) -> Reply:
        """`GET /t/{id}/v1/models` (http.md §9.9)."""
        if self.model:
            listing = {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "owned_by": "skycap"}],
            }
            return Reply(200, {"content-type": "application/json"}, orjson.dumps(listing))
        try:
            response = await self.client.models()
        except httpx.HTTPError as exc:
            url = self.client.models_url
            return _error(CHAT, 502, f"engine: {type(exc).__name__} calling {url}: {exc}")
        content_type = response.headers.get("content-type", "application/json")
        return Reply(response.status_code, {"content-type": content_type}, response.content)

    async def _list_models(self) -> tuple[int, bytes]:
        """GET the engine's `/v1/models`: (status, body); transport failures raise httpx errors."""
        response = await self.client.models(timeout=CONNECT_TIMEOUT)
        return response.status_code, response.content

    async def release(self, trajectory_id: str) -> None:
        """Drop the trajectory's turn state and release the engine's (best effort, http.md §11)."""
        self._states.pop(trajectory_id, None)
        await self.client.release(trajectory_id)

    async def close(self) -> None:
        """Close the HTTP client and stop the renderer threads (off the event loop)."""
        await self.served.close()
        await self.client.close()
        await asyncio.to_thread(self._pool.close)

    def decode_spans(self, token_ids: Any, context: Any = ()) -> tuple[bytes, list[int]]:
        """Decode a node's tokens with byte offsets (format.md §10.2); blocking, thread-safe.

        For the record writer, which calls it from a worker thread; it holds a renderer
        slot like any other renderer work.
        """
        return self._pool.call(lambda r: r.decode_spans(token_ids, context))


def _reasoning_tokens(completion_ids: Sequence[int], think_end: int | None) -> int:
    """The completion's tokens through the end of its thinking (Responses usage), or 0."""
    if think_end is None:
        return 0
    for position, token in enumerate(completion_ids):
        if token == think_end:
            return position + 1
    return 0


def _too_long(trajectory: Trajectory, dialect: Dialect, message: str) -> _TurnFailed:
    """A `context_length_exceeded` refusal, remembered for the finish answer (http.md §2.3)."""
    trajectory.context_length_exceeded = True
    return _TurnFailed(_error(dialect, 400, message, CONTEXT_LENGTH_EXCEEDED))


def _error(
    dialect: Dialect,
    status: int,
    message: str,
    code: str | None = None,
    *,
    param: str | None = None,
) -> Reply:
    """A refusal or failure in the caller's dialect (D-36); `param` names the field at fault."""
    body = dialect.error(status, message, code, param)
    return Reply(status, {"content-type": "application/json"}, body)


def _call_extras(output: EngineOutput, stop: StopMatch | None) -> dict[str, Any]:
    """The call fields recorded only when they apply (D-41)."""
    extras: dict[str, Any] = {}
    if stop is not None:
        extras["stop_string"] = stop.stop
    missing = output.missing_logprobs
    if missing:
        extras["missing_logprobs"] = missing
    if output.engine_finish_reason is not None:
        extras["engine_finish_reason"] = output.engine_finish_reason
    return extras

"""One token-mode turn, from the read call to its answer (http.md §3.2), as one object: plan
the prompt, refuse what cannot run, build the engine request, call the engine (buffered, or
streamed through the relay), check and parse the completion, build the call record,
commit, and answer in the call's dialect, streamed or whole.

Every step raises TurnError, which says nothing of a dialect; TokenBackend.call writes it
as the caller's error body. An engine failure is recorded on the trajectory's failures first.
Renderer work runs on the renderer pool's threads; the commit runs on the event loop, as
does the plan of a small new trajectory's first call the render cache holds (a lookup, no
renderer work). The caller holds the trajectory's turn lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from skycap.calls import call_record, harness_mark, reply_id_mark
from skycap.dialects import Dialect, ReplyData, Request
from skycap.dialects.tool_choice import names_a_function
from skycap.dialects.writers import stream_writer
from skycap.hashing import model_key, tools_hash
from skycap.tokens.client import engine_status_message
from skycap.tokens.commit import CommitError, commit_turn
from skycap.tokens.engine import EngineError, EngineOutput, merge_sampling
from skycap.tokens.interned import turn_lists
from skycap.tokens.outcome import Reply, TurnError, closed, too_long
from skycap.tokens.plan import Plan, PlanError, TurnLists, plan_turn
from skycap.tokens.relay import Relay
from skycap.tokens.renderer import Renderer, RenderError
from skycap.tokens.reply import answered_message, finish_reason, reply_message
from skycap.tokens.sampling import (
    SamplingError,
    check_mask_constraints,
    stop_strings,
    validate_cache_salt,
    validate_sampling,
)
from skycap.tokens.settings import TokenSettings
from skycap.tokens.stops import StopMatch, apply_stop, strip_stop
from skycap.tokens.streaming import EngineRefused, StreamedCompletion
from skycap.trajectory import FAILED, Trajectory

ENGINE_ERROR_BODY_LIMIT = 2000
#: The flag a vLLM server needs for sampling masks (config/model.py `return_sampling_mask`).
MASK_FLAG = "--return-sampling-mask"
#: What a new trajectory's first call may cost to look up in the render cache on the event
#: loop (fits_on_loop): about 64k characters of messages and tools, some 16k tokens, which
#: hash and copy out of the cache in well under a millisecond.
LOOP_LOOKUP_BUDGET = 64_000
#: What fits_on_loop charges for a value other than a string.
LOOP_VALUE_COST = 64


@dataclass
class TrajectoryState:
    """Per-trajectory turn state, in memory only: the turn lock, the experts layout every
    call of the trajectory shares, the last committed turn's token lists for the next plan
    to extend, and the replies a dialect with reply ids answered, for
    `GET …/v1/responses/{id}`."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    experts_shape: tuple[int, ...] | None = None
    last_turn: TurnLists | None = None
    replies: dict[str, bytes] = field(default_factory=dict)


class TokenTurn:
    """One call's turn: what every step reads, and one method per step."""

    def __init__(
        self,
        settings: TokenSettings,
        trajectory: Trajectory,
        request: Request,
        dialect: Dialect,
        state: TrajectoryState,
        relay: Relay | None,
        harness_present: Callable[[], bool] | None,
    ) -> None:
        self.settings = settings
        self.options = settings.options
        self.trajectory = trajectory
        self.request = request
        self.dialect = dialect
        self.state = state
        self.relay = relay
        self.harness_present = harness_present
        # A dialect whose tools a template cannot all express renders fewer.
        extras = request.extras
        self.tools: list[Any] | None = (
            extras["token_tools"] if "token_tools" in extras else request.tools
        )

    async def run(self) -> Reply:
        """Run the turn; raises TurnError for a refusal or a failure before the commit."""
        t_start = time.time()
        settings, request, dialect, relay = self.settings, self.request, self.dialect, self.relay
        if not self.trajectory.is_open:
            raise closed(self.trajectory)
        if request.token_refusal is not None:
            raise TurnError(400, request.token_refusal)
        served = await settings.served.on_call(settings.client.list_models)
        model = served or model_key(request.model)
        plan = await self.plan(model)
        room = self.check_limits(len(plan.prompt_ids))
        sampling, body = self.engine_request(plan, room, served)
        reply_id = dialect.reply_id()
        answered_model = self.answered_model()
        streamed: StreamedCompletion | None = None
        if relay is not None:
            head = ReplyData(
                reply_id, int(time.time()), answered_model, {}, "", len(plan.prompt_ids), 0, request
            )
            relay.open(stream_writer(dialect, head, settings.reasoning_keys()))
            streamed = await self.stream(relay, plan, sampling, body)
        if streamed is None:
            output = await self.generate(body, plan.routes_from)
            self.check_mask(output)
            stop = await self.cut_at_stop(output, sampling, plan)
        else:
            output, stop = streamed.output, streamed.stop
            self.check_mask(output)
        stored = await self.reply_message(plan, output, stop)
        think = reasoning_tokens(output.completion_ids, settings.think_end)
        reasoning_ids = output.completion_ids[:think] if think else None
        stored = dialect.issue(stored, output.completion_ids, reasoning_ids)
        if relay is not None:
            stored = relay.finish_parts(stored, None if streamed is None else streamed.reasoning)
        reason = "stop" if stop else finish_reason(output.finish_reason, stored)
        if reason == "tool_calls" and names_a_function(request.extras.get("tool_choice")):
            reason = dialect.forced_tool_finish
        requested = request.model if isinstance(request.model, str) else None
        saw_end = self.harness_present is None or self.harness_present()
        call = call_record(
            request,
            dialect,
            t_start=t_start,
            model=served or requested,
            sampling={k: v for k, v in sampling.items() if k != "stop_token_ids"},
            usage={
                "prompt_tokens": len(plan.prompt_ids),
                "completion_tokens": len(output.completion_ids),
            },
            finish_reason=reason,
            measured=_measured(output, stop),
            marks={
                **_omitted_tools(request),
                **reply_id_mark(dialect, reply_id),
                **harness_mark(saw_end),
            },
        )
        status = self.commit(plan, output, stored, call, model)
        answered = answered_message(
            stored,
            use_raw_content=self.options.use_raw_content,
            reasoning_field=self.options.reasoning_field,
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
            reasoning_tokens=think,
        )
        if status == "ok" and dialect.reply_id_key is not None:
            self.state.replies[reply_id] = dialect.reply_json(data)  # GET …/{reply id}
        reply = self.answer(data, status)
        committed = call if status == "ok" else None
        if relay is not None:
            relay.end(data)
        return Reply(reply.status, reply.headers, reply.body, reply.replayable, committed)

    # -- before inference ---------------------------------------------------------------

    async def plan(self, model: str) -> Plan:
        """The prompt, bridged from the last turn where it can be; a 400 if it cannot.

        A new trajectory's first call needs only a full render; when the render cache holds
        it and the call is small enough to hash on the event loop, it is planned there,
        sparing the hop to a renderer thread and back (a GRPO group's repetitions).
        """
        graph, messages, tools = self.trajectory.graph, self.request.messages, self.tools
        key, last_turn = tools_hash(tools), self.state.last_turn

        def planned(renderer: Renderer) -> Plan:
            return plan_turn(graph, renderer, messages, tools, key, model, last_turn)

        try:
            if not len(graph) and fits_on_loop(messages, tools):
                cached = self.settings.pool.from_cache(planned)
                if cached is not None:
                    return cached
            return await self.settings.pool.run(planned)
        except PlanError as exc:
            raise TurnError(400, str(exc)) from exc

    def check_limits(self, prompt_tokens: int) -> int | None:
        """Refusals before inference (http.md §3.2); returns the room left, if bounded."""
        bound = self.request.extras.get("max_prompt_tokens")
        if bound is not None:
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
                message = f"max_prompt_tokens must be a non-negative integer, got {bound!r}"
                raise TurnError(400, message)
            if prompt_tokens > bound:
                raise too_long(
                    self.trajectory,
                    f"prompt of {prompt_tokens} tokens exceeds max_prompt_tokens={bound}",
                )
        max_model_len = self.options.max_model_len
        if max_model_len is None:
            return None
        room = max_model_len - prompt_tokens
        if room <= 0:
            raise too_long(
                self.trajectory,
                f"prompt of {prompt_tokens} tokens leaves no room within "
                f"max_model_len={max_model_len}",
            )
        return room

    def engine_request(
        self, plan: Plan, room: int | None, model: str | None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(effective sampling, engine request body) (http.md §3.2).

        The model's generation defaults fill what the caller left out, then the overrides
        win. What vLLM would refuse answers 400 naming the field.
        """
        settings, request = self.settings, self.request
        caller = dict(request.sampling)
        if "max_completion_tokens" in caller:
            caller["max_tokens"] = caller.pop("max_completion_tokens")
        cache_salt = request.extras.get("cache_salt")
        sampling_mask = self.options.sampling_mask
        try:
            validate_cache_salt(cache_salt)
            sampling = merge_sampling(
                {**settings.generation_defaults, **caller},
                settings.sampling_overrides,
                room=room,
                stop_token_ids=settings.stop_token_ids,
            )
            validate_sampling(sampling)
            if sampling_mask:
                check_mask_constraints(sampling, "this request")
            body = settings.engine.request(
                prompt_ids=plan.prompt_ids,
                sampling=sampling,
                model=model,
                cache_salt=cache_salt,
                sampling_mask=sampling_mask,
                routes_from=plan.routes_from,
            )
        except SamplingError as exc:
            raise TurnError(400, str(exc), param=exc.param) from exc
        except ValueError as exc:
            raise TurnError(400, str(exc)) from exc
        return sampling, body

    # -- the engine call ----------------------------------------------------------------

    async def generate(self, body: dict[str, Any], routes_from: int) -> EngineOutput:
        """Call the engine and read its reply; failures are recorded and answered 502/5xx."""
        settings = self.settings
        try:
            status, content = await settings.client.generate(self.trajectory.id, orjson.dumps(body))
            if status != 200:
                raise self.engine_refused(status, content)
            try:
                data = orjson.loads(content)
            except orjson.JSONDecodeError as exc:
                raise EngineError(f"the reply is not JSON: {exc}") from exc
            return settings.engine.parse(data, routes_from=routes_from)
        except EngineError as exc:
            raise self.engine_failed(exc) from exc

    async def stream(
        self, relay: Relay, plan: Plan, sampling: Mapping[str, Any], body: dict[str, Any]
    ) -> StreamedCompletion | None:
        """Generate with the engine's stream, relaying deltas; None when the wire declines."""
        try:
            return await relay.generate(
                self.settings, self.trajectory.id, body, plan, self.tools, self.dialect, sampling
            )
        except EngineRefused as refused:
            raise self.engine_refused(refused.status, refused.body) from None
        except (EngineError, RenderError) as exc:
            raise self.engine_failed(exc) from exc

    def engine_refused(self, status: int, body: bytes) -> TurnError:
        """The engine answered with an HTTP error: recorded, and passed on as a 502/5xx."""
        text = body[:ENGINE_ERROR_BODY_LIMIT].decode("utf-8", "replace")
        self.trajectory.add_failure(status, text)
        return TurnError(status if status >= 500 else 502, engine_status_message(status, text))

    def engine_failed(self, exc: Exception) -> TurnError:
        """The engine's reply cannot be used: recorded, and answered 502 `engine: …`."""
        problem = f"engine: {exc}"
        self.trajectory.add_failure(None, problem)
        return TurnError(502, problem)

    # -- what the engine returned -------------------------------------------------------

    def check_mask(self, output: EngineOutput) -> None:
        """With `--sampling-mask`, a reply without masks means the engine lacks the flag."""
        if self.options.sampling_mask and output.sampling_mask is None:
            problem = (
                "engine: sampling masks were asked for (--sampling-mask) but the engine "
                f"returned none; start vLLM (0.33 or later) with {MASK_FLAG}, or drop "
                "--sampling-mask"
            )
            self.trajectory.add_failure(None, problem)
            raise TurnError(502, problem)

    async def cut_at_stop(
        self, output: EngineOutput, sampling: Mapping[str, Any], plan: Plan
    ) -> StopMatch | None:
        """Cut the completion at the first stop string, in place; the match or None.

        Every dialect's stop strings arrive as the canonical `stop` (Chat Completions
        `stop`, Anthropic `stop_sequences`).
        """
        stops = stop_strings(sampling)
        if not stops:
            return None
        min_tokens = sampling.get("min_tokens") or 0
        skip = self.settings.skip_special_tokens
        return await self.settings.pool.run(
            lambda r: apply_stop(
                r, output, stops, plan.prompt_ids, min_tokens=min_tokens, skip_special_tokens=skip
            )
        )

    async def reply_message(
        self, plan: Plan, output: EngineOutput, stop: StopMatch | None
    ) -> dict[str, Any]:
        """The reply message to store; a completion the renderer cannot read is a 502.

        After a stop string it is the message without it (what the harness will echo).
        """
        settings, tools = self.settings, self.tools
        try:
            stored = await settings.pool.run(
                lambda r: reply_message(
                    r,
                    output.completion_ids,
                    tools,
                    plan.prompt_ids,
                    use_raw_content=self.options.use_raw_content,
                    skip_special_tokens=settings.skip_special_tokens,
                )
            )
        except RenderError as exc:
            raise self.engine_failed(exc) from exc
        return stored if stop is None else strip_stop(stored, stop)

    # -- the commit and the answer ------------------------------------------------------

    def commit(
        self,
        plan: Plan,
        output: EngineOutput,
        stored: dict[str, Any],
        call: dict[str, Any],
        model: str,
    ) -> str:
        """Commit on the event loop; a CommitError seals the trajectory `failed`
        (docs/tokens.md "Outcomes the harness sees")."""
        trajectory, state = self.trajectory, self.state
        try:
            node = commit_turn(
                trajectory,
                plan,
                output,
                stored,
                call,
                tools=self.tools,
                model=model,
                experts_shape=state.experts_shape,
            )
        except CommitError as exc:
            trajectory.add_failure(None, f"token attribution: {exc}")
            trajectory.seal(FAILED)
            return "failed"
        if node is None:
            raise closed(trajectory)
        if output.routed_experts is not None and state.experts_shape is None:
            state.experts_shape = tuple(output.routed_experts.shape[1:])
        state.last_turn = turn_lists(trajectory.graph, node.id, plan, output, state.last_turn)
        return "ok"

    def answered_model(self) -> str:
        requested = self.request.model
        if isinstance(requested, str) and requested:
            return requested
        return self.settings.served.name or ""

    def answer(self, data: ReplyData, status: str) -> Reply:
        headers = {"x-skycap-status": status}
        if self.request.stream:
            headers |= {"content-type": "text/event-stream", "cache-control": "no-cache"}
            payload = self.dialect.reply_sse(data)
        else:
            headers["content-type"] = "application/json"
            payload = self.dialect.reply_json(data)
        return Reply(200, headers, payload, replayable=status == "ok")


def fits_on_loop(*values: Any) -> bool:
    """Whether `values` (a call's messages and tools) are small enough to look up in the
    render cache on the event loop, where hashing them must stay well under a millisecond.

    A string costs its length, any other value LOOP_VALUE_COST (hashing one is a Python
    step, not a byte); a container is charged for its items before they are walked, so the
    walk stops as soon as the budget is spent and this check is bounded too.
    """
    budget = LOOP_LOOKUP_BUDGET
    pending = list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            budget -= len(value)
        elif isinstance(value, dict | list):
            budget -= LOOP_VALUE_COST * (len(value) + 1)
            if budget >= 0:
                pending.extend(value)  # a dict's keys, strings charged by length
                if isinstance(value, dict):
                    pending.extend(value.values())
        if budget < 0:
            return False
    return True


def reasoning_tokens(completion_ids: Sequence[int], think_end: int | None) -> int:
    """The completion's tokens through the end of its thinking (Responses usage), or 0."""
    if think_end is None:
        return 0
    for position, token in enumerate(completion_ids):
        if token == think_end:
            return position + 1
    return 0


def _measured(output: EngineOutput, stop: StopMatch | None) -> dict[str, Any]:
    """The call fields recorded only when they apply."""
    extras: dict[str, Any] = {}
    if stop is not None:
        extras["stop_string"] = stop.stop
    missing = output.missing_logprobs
    if missing:
        extras["missing_logprobs"] = missing
    if output.engine_finish_reason is not None:
        extras["engine_finish_reason"] = output.engine_finish_reason
    if output.weight_versions is not None:
        extras["weight_versions"] = output.weight_versions
    return extras


def _omitted_tools(request: Request) -> dict[str, Any]:
    """The tools the template could not express, when the dialect left some out."""
    omitted = request.extras.get("omitted_tools")
    return {"omitted_tools": omitted} if omitted else {}

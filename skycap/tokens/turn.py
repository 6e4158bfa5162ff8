"""One token-mode turn, from the read call to its answer (http.md §3.2): plan the prompt,
run the engine steps (skycap.tokens.inference), parse the completion, build the call
record, commit, and answer in the call's dialect, streamed or whole.

Renderer work runs on the renderer pool's threads; the commit runs on the event loop. The
caller (TokenBackend.call) holds the trajectory's turn lock and maps failures to replies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from skycap.dialects import Dialect, ReplyData, Request
from skycap.dialects.tool_choice import names_a_function
from skycap.dialects.writers import stream_writer
from skycap.hashing import model_key, tools_hash
from skycap.tokens import inference
from skycap.tokens.commit import CommitError, commit_turn
from skycap.tokens.engine import EngineOutput
from skycap.tokens.interned import turn_lists
from skycap.tokens.outcome import Reply, TurnFailed, closed, error
from skycap.tokens.plan import Plan, PlanError, TurnLists, plan_turn
from skycap.tokens.relay import Relay
from skycap.tokens.renderer import RenderError
from skycap.tokens.reply import answered_message, finish_reason, reply_message
from skycap.tokens.settings import TokenSettings
from skycap.tokens.stops import StopMatch, strip_stop
from skycap.tokens.streaming import StreamedCompletion
from skycap.trajectory import FAILED, Trajectory


@dataclass
class TrajectoryState:
    """Per-trajectory turn state, in memory only: the turn lock, the experts layout,
    the last committed turn's token lists for the next plan, and the replies a
    dialect with reply ids answered, for `GET …/v1/responses/{id}`."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    experts_shape: tuple[int, ...] | None = None
    last_turn: TurnLists | None = None
    replies: dict[str, bytes] = field(default_factory=dict)


async def run_turn(
    settings: TokenSettings,
    trajectory: Trajectory,
    request: Request,
    dialect: Dialect,
    state: TrajectoryState,
    relay: Relay | None,
    harness_present: Callable[[], bool] | None,
) -> Reply:
    """Run one turn; raises TurnFailed for a refusal or a failure before the commit."""
    t_start = time.time()
    # A dialect whose tools a template cannot all express renders fewer.
    tools = request.extras["token_tools"] if "token_tools" in request.extras else request.tools
    served = await settings.served.on_call(settings.client.list_models)
    model = served or model_key(request.model)
    plan = await _plan(settings, trajectory, request, tools, model, state.last_turn, dialect)
    room = inference.check_limits(settings, trajectory, request, len(plan.prompt_ids), dialect)
    sampling, body = inference.engine_request(settings, request, plan, room, served, dialect)
    reply_id = dialect.reply_id()
    answered_model = _answered_model(settings, request)
    streamed: StreamedCompletion | None = None
    if relay is not None:
        head = ReplyData(
            reply_id, int(time.time()), answered_model, {}, "", len(plan.prompt_ids), 0, request
        )
        relay.open(stream_writer(dialect, head, settings.reasoning_keys()))
        streamed = await inference.stream(
            settings, trajectory, dialect, plan, tools, sampling, body, relay
        )
    if streamed is None:
        output = await inference.generate(settings, trajectory, body, plan.routes_from, dialect)
        inference.check_mask(settings, trajectory, output, dialect)
        stop = await inference.cut_at_stop(settings, output, sampling, plan)
    else:
        output, stop = streamed.output, streamed.stop
        inference.check_mask(settings, trajectory, output, dialect)
    stored = await _reply_message(settings, trajectory, plan, output, tools, stop, dialect)
    think = reasoning_tokens(output.completion_ids, settings.think_end)
    reasoning_ids = output.completion_ids[:think] if think else None
    stored = dialect.issue(stored, output.completion_ids, reasoning_ids)
    if relay is not None:
        stored = relay.finish_parts(stored, None if streamed is None else streamed.reasoning)
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
        call["harness_saw_end"] = False  # committed after the harness went away
    status = _commit(trajectory, plan, output, stored, call, tools, model, state, dialect)
    answered = answered_message(
        stored, use_raw_content=settings.use_raw_content, reasoning_field=settings.reasoning_field
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
        state.replies[reply_id] = dialect.reply_json(data)  # GET …/{reply id}
    reply = _answer(request, dialect, data, status)
    committed = call if status == "ok" else None
    if relay is not None:
        relay.end(data)
    return Reply(reply.status, reply.headers, reply.body, reply.replayable, committed)


async def _plan(
    settings: TokenSettings,
    trajectory: Trajectory,
    request: Request,
    tools: list[Any] | None,
    model: str,
    last_turn: TurnLists | None,
    dialect: Dialect,
) -> Plan:
    key = tools_hash(tools)
    messages = request.messages
    try:
        return await settings.pool.run(
            lambda r: plan_turn(trajectory.graph, r, messages, tools, key, model, last_turn)
        )
    except PlanError as exc:
        raise TurnFailed(error(dialect, 400, str(exc))) from exc


async def _reply_message(
    settings: TokenSettings,
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
        stored = await settings.pool.run(
            lambda r: reply_message(
                r,
                output.completion_ids,
                tools,
                plan.prompt_ids,
                use_raw_content=settings.use_raw_content,
                skip_special_tokens=settings.skip_special_tokens,
            )
        )
    except RenderError as exc:
        trajectory.add_failure(None, f"engine: {exc}")
        raise TurnFailed(error(dialect, 502, f"engine: {exc}")) from exc
    return stored if stop is None else strip_stop(stored, stop)


def _commit(
    trajectory: Trajectory,
    plan: Plan,
    output: EngineOutput,
    stored: dict[str, Any],
    call: dict[str, Any],
    tools: list[Any] | None,
    model: str,
    state: TrajectoryState,
    dialect: Dialect,
) -> str:
    """Commit on the event loop; a CommitError seals the trajectory `failed`
    (docs/tokens.md "Outcomes the harness sees")."""
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
        raise TurnFailed(closed(trajectory, dialect))
    if output.routed_experts is not None and state.experts_shape is None:
        state.experts_shape = tuple(output.routed_experts.shape[1:])
    state.last_turn = turn_lists(trajectory.graph, node.id, plan, output, state.last_turn)
    return "ok"


def _answered_model(settings: TokenSettings, request: Request) -> str:
    requested = request.model
    return requested if isinstance(requested, str) and requested else settings.served.name or ""


def _answer(request: Request, dialect: Dialect, data: ReplyData, status: str) -> Reply:
    headers = {"x-skycap-status": status}
    if request.stream:
        headers |= {"content-type": "text/event-stream", "cache-control": "no-cache"}
        payload = dialect.reply_sse(data)
    else:
        headers["content-type"] = "application/json"
        payload = dialect.reply_json(data)
    return Reply(200, headers, payload, replayable=status == "ok")


def reasoning_tokens(completion_ids: Sequence[int], think_end: int | None) -> int:
    """The completion's tokens through the end of its thinking (Responses usage), or 0."""
    if think_end is None:
        return 0
    for position, token in enumerate(completion_ids):
        if token == think_end:
            return position + 1
    return 0


def _call_extras(output: EngineOutput, stop: StopMatch | None) -> dict[str, Any]:
    """The call fields recorded only when they apply."""
    extras: dict[str, Any] = {}
    if stop is not None:
        extras["stop_string"] = stop.stop
    missing = output.missing_logprobs
    if missing:
        extras["missing_logprobs"] = missing
    if output.engine_finish_reason is not None:
        extras["engine_finish_reason"] = output.engine_finish_reason
    return extras

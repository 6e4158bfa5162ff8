"""A turn's engine steps: the refusals before inference, the engine request, the call itself
(buffered, or streamed through the relay) and the checks on what the engine returned.

Each step either returns what the turn goes on with or raises TurnFailed with the reply in
the caller's dialect; an engine failure is recorded on the trajectory first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from skycap.dialects import Dialect, Request
from skycap.tokens.client import engine_status_message
from skycap.tokens.engine import EngineError, EngineOutput, merge_sampling
from skycap.tokens.outcome import TurnFailed, error, too_long
from skycap.tokens.plan import Plan
from skycap.tokens.relay import Relay
from skycap.tokens.renderer import RenderError
from skycap.tokens.sampling import (
    SamplingError,
    check_mask_constraints,
    stop_strings,
    validate_cache_salt,
    validate_sampling,
)
from skycap.tokens.settings import TokenSettings
from skycap.tokens.stops import StopMatch, apply_stop
from skycap.tokens.streaming import EngineRefused, StreamedCompletion
from skycap.trajectory import Trajectory

ENGINE_ERROR_BODY_LIMIT = 2000
#: The flag a vLLM server needs for sampling masks (config/model.py `return_sampling_mask`).
MASK_FLAG = "--return-sampling-mask"


def check_limits(
    settings: TokenSettings,
    trajectory: Trajectory,
    request: Request,
    prompt_tokens: int,
    dialect: Dialect,
) -> int | None:
    """Refusals before inference (http.md §3.2); returns the room left, if bounded."""
    bound = request.extras.get("max_prompt_tokens")
    if bound is not None:
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            message = f"max_prompt_tokens must be a non-negative integer, got {bound!r}"
            raise TurnFailed(error(dialect, 400, message))
        if prompt_tokens > bound:
            raise too_long(
                trajectory,
                dialect,
                f"prompt of {prompt_tokens} tokens exceeds max_prompt_tokens={bound}",
            )
    if settings.max_model_len is None:
        return None
    room = settings.max_model_len - prompt_tokens
    if room <= 0:
        raise too_long(
            trajectory,
            dialect,
            f"prompt of {prompt_tokens} tokens leaves no room within "
            f"max_model_len={settings.max_model_len}",
        )
    return room


def engine_request(
    settings: TokenSettings,
    request: Request,
    plan: Plan,
    room: int | None,
    model: str | None,
    dialect: Dialect,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(effective sampling, engine request body) (http.md §3.2).

    The model's generation defaults fill what the caller left out, then the overrides
    win. What vLLM would refuse answers 400 naming the field.
    """
    caller = dict(request.sampling)
    if "max_completion_tokens" in caller:
        caller["max_tokens"] = caller.pop("max_completion_tokens")
    cache_salt = request.extras.get("cache_salt")
    try:
        validate_cache_salt(cache_salt)
        sampling = merge_sampling(
            {**settings.generation_defaults, **caller},
            settings.sampling_overrides,
            room=room,
            stop_token_ids=settings.stop_token_ids,
        )
        validate_sampling(sampling)
        if settings.sampling_mask:
            check_mask_constraints(sampling, "this request")
        body = settings.engine.request(
            prompt_ids=plan.prompt_ids,
            sampling=sampling,
            model=model,
            cache_salt=cache_salt,
            sampling_mask=settings.sampling_mask,
            routes_from=plan.routes_from,
        )
    except SamplingError as exc:
        raise TurnFailed(error(dialect, 400, str(exc), param=exc.param)) from exc
    except ValueError as exc:
        raise TurnFailed(error(dialect, 400, str(exc))) from exc
    return sampling, body


async def generate(
    settings: TokenSettings,
    trajectory: Trajectory,
    body: dict[str, Any],
    routes_from: int,
    dialect: Dialect,
) -> EngineOutput:
    """Call the engine and read its reply; failures are recorded and answered 502/5xx."""
    try:
        status, content = await settings.client.generate(trajectory.id, orjson.dumps(body))
        if status != 200:
            text = content[:ENGINE_ERROR_BODY_LIMIT].decode("utf-8", "replace")
            trajectory.add_failure(status, text)
            reply = error(
                dialect, status if status >= 500 else 502, engine_status_message(status, text)
            )
            raise TurnFailed(reply)
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"the reply is not JSON: {exc}") from exc
        return settings.engine.parse(data, routes_from=routes_from)
    except EngineError as exc:
        problem = f"engine: {exc}"
        trajectory.add_failure(None, problem)
        raise TurnFailed(error(dialect, 502, problem)) from exc


async def stream(
    settings: TokenSettings,
    trajectory: Trajectory,
    dialect: Dialect,
    plan: Plan,
    tools: list[Any] | None,
    sampling: Mapping[str, Any],
    body: dict[str, Any],
    relay: Relay,
) -> StreamedCompletion | None:
    """Generate with the engine's stream, relaying deltas; None when the wire declines."""
    try:
        return await relay.generate(
            settings.client,
            settings.pool,
            session_id=trajectory.id,
            engine_request=body,
            plan=plan,
            tools=tools,
            dialect=dialect,
            stops=stop_strings(sampling),
            min_tokens=sampling.get("min_tokens") or 0,
            raw=settings.use_raw_content,
            skip_special_tokens=settings.skip_special_tokens,
            think_end=settings.think_end,
            stop_token_ids=settings.stop_token_ids,
        )
    except EngineRefused as refused:
        text = refused.body[:ENGINE_ERROR_BODY_LIMIT].decode("utf-8", "replace")
        trajectory.add_failure(refused.status, text)
        status = refused.status if refused.status >= 500 else 502
        raise TurnFailed(
            error(dialect, status, engine_status_message(refused.status, text))
        ) from None
    except (EngineError, RenderError) as exc:
        problem = f"engine: {exc}"
        trajectory.add_failure(None, problem)
        raise TurnFailed(error(dialect, 502, problem)) from exc


def check_mask(
    settings: TokenSettings, trajectory: Trajectory, output: EngineOutput, dialect: Dialect
) -> None:
    """With `--sampling-mask`, a reply without masks means the engine lacks the flag."""
    if settings.sampling_mask and output.sampling_mask is None:
        problem = (
            "engine: sampling masks were asked for (--sampling-mask) but the engine "
            f"returned none; start vLLM (0.33 or later) with {MASK_FLAG}, or drop "
            "--sampling-mask"
        )
        trajectory.add_failure(None, problem)
        raise TurnFailed(error(dialect, 502, problem))


async def cut_at_stop(
    settings: TokenSettings, output: EngineOutput, sampling: Mapping[str, Any], plan: Plan
) -> StopMatch | None:
    """Cut the completion at the first stop string, in place; the match or None.

    Every dialect's stop strings arrive as the canonical `stop` (Chat Completions
    `stop`, Anthropic `stop_sequences`).
    """
    stops = stop_strings(sampling)
    if not stops:
        return None
    min_tokens = sampling.get("min_tokens") or 0
    return await settings.pool.run(
        lambda r: apply_stop(
            r,
            output,
            stops,
            plan.prompt_ids,
            min_tokens=min_tokens,
            skip_special_tokens=settings.skip_special_tokens,
        )
    )

"""The token-mode backend the server plugs in: its options, the turn entry, the other routes.

The server routes and gates requests (http.md §3) and hands a call read by its dialect
(skycap.dialects) here; `call` takes the per-trajectory turn lock and runs the turn
(skycap.tokens.turn: plan, engine call, commit and reply, http.md §3.2), answering in the
call's dialect. Renderer work runs on the renderer pool's worker threads, never on the
event loop; the HTTP calls to the engine are skycap.tokens.client's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import orjson

from skycap.dialects import Dialect, Request
from skycap.dialects.chat import DIALECT as CHAT
from skycap.dialects.chat import REASONING_FIELDS
from skycap.tokens.client import EngineClient
from skycap.tokens.engine import VLLMEngine
from skycap.tokens.models import ServedModel
from skycap.tokens.outcome import Reply, TurnFailed, closed, error
from skycap.tokens.relay import Relay
from skycap.tokens.renderer import Renderer, RenderError
from skycap.tokens.renderer_pool import renderer_pool
from skycap.tokens.sampling import check_overrides, generation_folders, load_generation_config
from skycap.tokens.settings import TokenSettings
from skycap.tokens.streaming import ReplyStream
from skycap.tokens.turn import TrajectoryState, run_turn
from skycap.trajectory import Trajectory

logger = logging.getLogger(__name__)

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
        if reasoning_field not in REASONING_FIELDS:
            raise ValueError(
                f"reasoning_field must be one of {', '.join(REASONING_FIELDS)}, "
                f"got {reasoning_field!r}"
            )
        overrides = dict(sampling_overrides or {})
        check_overrides(overrides, sampling_mask)
        generation_defaults, self.generation_source = load_generation_config(
            generation_config, generation_folders(tokenizer)
        )
        self.upstream_url = upstream_url.rstrip("/")
        engine = engine or VLLMEngine()
        pool = renderer_pool(
            tokenizer, renderer, renderer_name, chat_template_kwargs, renderer_pool_size
        )
        self.settings = TokenSettings(
            engine=engine,
            client=EngineClient(self.upstream_url, api_key, engine, upstream_timeout),
            served=ServedModel(model or None),
            pool=pool,
            max_model_len=max_model_len,
            reasoning_field=reasoning_field,
            sampling_overrides=overrides,
            sampling_mask=sampling_mask,
            logprobs_mode=logprobs_mode,
            use_raw_content=use_raw_content,
            keep_special_tokens=keep_special_tokens,
            generation_defaults=generation_defaults,
            stop_token_ids=list(pool.primary.stop_token_ids),
            think_end=getattr(pool.primary, "think_end_id", None),
        )
        self.client = self.settings.client
        self.served = self.settings.served
        self._pool = pool
        self._states: dict[str, TrajectoryState] = {}

    @classmethod
    def from_options(cls, options: Any) -> TokenBackend:
        """Build from the server's options object, reading the OPTION_NAMES attributes it has."""
        return cls(
            **{name: getattr(options, name) for name in OPTION_NAMES if hasattr(options, name)}
        )

    @property
    def capture(self) -> dict[str, Any]:
        """The `capture` object of every token-mode trajectory (format.md §4)."""
        settings = self.settings
        return {
            "mode": "tokens",
            "engine": settings.engine.name,
            "tokenizer": self._pool.primary.name,
            "logprobs_mode": settings.logprobs_mode,
            "sampling_overrides": settings.sampling_overrides,
            "use_raw_content": settings.use_raw_content,
        }

    @property
    def model(self) -> str | None:
        """The served model name (`--model`, or learned from the engine), once known."""
        return self.served.name

    async def start(self) -> None:
        """Learn the served model name from the engine's `/v1/models`, briefly.

        Retries with backoff for a few seconds here; if the engine is not up yet, keeps
        retrying in the background, and the first call asks again.
        """
        await self.served.start(self.client.list_models)

    # -- a harness call -------------------------------------------------------------------

    async def call(
        self,
        trajectory: Trajectory,
        request: Request,
        dialect: Dialect,
        stream: ReplyStream | None = None,
        harness_present: Callable[[], bool] | None = None,
    ) -> Reply:
        """Run one turn for a call read by `dialect` (http.md §3.2); always returns a Reply.

        With `stream` (a streamed call), the reply is written there as it is generated once
        nothing can refuse the call; a failure after that ends it with the dialect's error
        event. The Reply returned is then the whole stream, for retries to replay.
        `harness_present`, asked at the commit, says whether the harness is still there to
        receive the reply's end; a call committed without it is marked.
        """
        state = self._states.setdefault(trajectory.id, TrajectoryState())
        async with state.lock:
            if not trajectory.is_open:
                return closed(trajectory, dialect)
            if request.token_refusal is not None:
                return error(dialect, 400, request.token_refusal)
            relay = Relay(stream) if stream is not None and request.stream else None
            try:
                return await run_turn(
                    self.settings, trajectory, request, dialect, state, relay, harness_present
                )
            except TurnFailed as failed:
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
            return error(dialect, 400, str(exc))
        return len(rendered.token_ids)

    async def models(self) -> Reply:
        """`GET /t/{id}/v1/models` (http.md §3.2)."""
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
            return error(CHAT, 502, f"engine: {type(exc).__name__} calling {url}: {exc}")
        content_type = response.headers.get("content-type", "application/json")
        return Reply(response.status_code, {"content-type": content_type}, response.content)

    async def release(self, trajectory_id: str) -> None:
        """Drop the trajectory's turn state and release the engine's
        (best effort, docs/tokens.md "Engines and renderers")."""
        self._states.pop(trajectory_id, None)
        await self.client.release(trajectory_id)

    async def close(self) -> None:
        """Close the HTTP client and stop the renderer threads (off the event loop)."""
        await self.served.close()
        await self.client.close()
        await asyncio.to_thread(self._pool.close)

    def decode_spans(self, token_ids: Any, context: Any = ()) -> tuple[bytes, list[int]]:
        """Decode a node's tokens with byte offsets (format.md §6.1); blocking, thread-safe.

        For the record writer, which calls it from a worker thread; it holds a renderer
        slot like any other renderer work.
        """
        return self._pool.call(lambda r: r.decode_spans(token_ids, context))

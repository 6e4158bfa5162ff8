"""The token-mode backend the server plugs in: its options, the turn entry, the other routes.

The server routes and gates requests (http.md §3) and hands a call read by its dialect
(skycap.dialects) here; `call` takes the per-trajectory turn lock and runs the turn
(skycap.tokens.turn: plan, engine call, commit and reply, http.md §3.2), answering in the
call's dialect. Renderer work runs on the renderer pool's worker threads, never on the
event loop; the HTTP calls to the engine are skycap.tokens.client's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from skycap.dialects import Dialect, Request
from skycap.dialects.chat import DIALECT as CHAT
from skycap.tokens.options import OPTION_NAMES, TokenOptions
from skycap.tokens.outcome import Reply, TurnError, error, error_reply
from skycap.tokens.provenance import renderer_provenance, token_provenance
from skycap.tokens.relay import Relay
from skycap.tokens.renderer import RenderError
from skycap.tokens.settings import TokenSettings
from skycap.tokens.streaming import ReplyStream
from skycap.tokens.turn import TokenTurn, TrajectoryState
from skycap.trajectory import Trajectory


class TokenBackend:
    """Token mode for one server: a renderer pool, the engine wire and an HTTP client.

    Built from the TokenOptions keywords (skycap.tokens.options), checked once into the
    TokenSettings every turn reads; an unknown keyword raises TypeError.
    """

    def __init__(self, **options: Any) -> None:
        self.settings = TokenSettings.build(TokenOptions(**options))
        self.upstream_url = self.settings.upstream_url
        self.client = self.settings.client
        self.served = self.settings.served
        self._pool = self.settings.pool
        self._states: dict[str, TrajectoryState] = {}
        #: The engine's release, asked at start, and the renderer's part (provenance).
        self.engine_version: str | None = None
        self._renderer_provenance: dict[str, Any] | None = None
        self._pool_seconds: float | None = None

    @classmethod
    def from_options(cls, options: TokenOptions) -> TokenBackend:
        """Build from the server's options (a ServerOptions is a TokenOptions)."""
        return cls(**{name: getattr(options, name) for name in OPTION_NAMES})

    @property
    def capture(self) -> dict[str, Any]:
        """The `capture` object of every token-mode trajectory (format.md §4)."""
        settings = self.settings
        return {
            "mode": "tokens",
            "engine": settings.engine.name,
            "tokenizer": self._pool.primary.name,
            "logprobs_mode": settings.options.logprobs_mode,
            "sampling_overrides": settings.sampling_overrides,
            "use_raw_content": settings.options.use_raw_content,
        }

    @property
    def model(self) -> str | None:
        """The served model name (`--model`, or learned from the engine), once known."""
        return self.served.name

    async def start(self) -> None:
        """Build the renderer pool's slots, and learn the served model name from the
        engine's `/v1/models`, briefly.

        The slots are built off the event loop, so the first calls of a burst load no
        tokenizer. The model name is retried with backoff for a few seconds here; if the
        engine is not up yet, it keeps retrying in the background, and the first call asks
        again.
        """
        filling = asyncio.create_task(asyncio.to_thread(self._pool.fill))
        await self.served.start(self.client.list_models)
        self.engine_version = await self.client.engine_version()
        self._pool_seconds = await filling
        # Digesting the tokenizer's files reads megabytes: on a renderer thread, once.
        self._renderer_provenance = await self._pool.run(renderer_provenance)

    def provenance(self) -> dict[str, Any]:
        """The `provenance` of a trajectory created now (format.md §4)."""
        return token_provenance(
            self._renderer_provenance or renderer_provenance(self._pool.primary),
            self.served.name,
            self.engine_version,
        )

    def describe_pool(self) -> str:
        """The start banner's line about the renderer pool and the render cache."""
        pool, cache = self._pool, self._pool.cache
        built = "" if self._pool_seconds is None else f" built in {self._pool_seconds:.1f} s"
        held = "render cache off" if cache is None else f"render cache {cache.max_bytes >> 20} MiB"
        slots = "1 renderer slot" if pool.size == 1 else f"{pool.size} renderer slots"
        return f"{slots}{built}; {held}"

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
            relay = Relay(stream) if stream is not None and request.stream else None
            turn = TokenTurn(
                self.settings, trajectory, request, dialect, state, relay, harness_present
            )
            try:
                return await turn.run()
            except TurnError as failed:  # the one place a failed turn meets its dialect
                reply = error_reply(dialect, failed)
                if relay is not None:
                    relay.fail(reply.status, reply.body)
                return reply
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

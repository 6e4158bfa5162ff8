"""The served model name token mode sends to the engine: `--model`, or learned from `/v1/models`.

vLLM answers 404 for a `model` it does not serve (serve/engine/serving.py `_check_model`),
so the harness's own name ("gpt-4o", "policy") must never reach it. The name learned from
the engine acts exactly as `--model`: it is sent, recorded and listed. skycap asks at
start with backoff, keeps asking in the background while the engine is not up, and asks
once more on the first call that finds it still unknown; until then calls go without
`model`, which vLLM accepts (an empty name is its served model).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from skycap.tokens.engine import openai_model_ids

log = logging.getLogger(__name__)

#: Backoff between the start-up attempts, awaited before the server says it is ready.
START_DELAYS = (0.1, 0.2, 0.4, 0.8)
#: Then the background retries: doubling from the last start delay up to this interval.
RETRY_CAP = 10.0
#: And giving up after this many seconds (the first call still asks).
RETRY_FOR = 600.0

Lister = Callable[[], Awaitable[tuple[int, bytes]]]
#: The served names in a 200 listing's body (the engine wire's `served_names`).
Names = Callable[[bytes], list[str]]


class ServedModel:
    """The engine's served model name, once known; `source` says where it came from.

    `names` reads a listing from the engine's `route` (its wire's `served_names` and
    `models_path`).
    """

    def __init__(
        self, name: str | None, names: Names = openai_model_ids, route: str = "/v1/models"
    ) -> None:
        self.name = name
        self.names = names
        self.route = route
        self.source = "--model" if name else None
        #: Every name the engine listed, when learned (several: the first is used).
        self.listed: list[str] = []
        self.problem: str | None = None
        self._retry: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._asked_on_call = False

    def describe(self) -> str:
        """The start line's account of the model name."""
        if self.source == "--model":
            return f"model {self.name} (--model)"
        if self.name is not None:
            also = (
                f"; the engine also serves {', '.join(self.listed[1:])}"
                if len(self.listed) > 1
                else ""
            )
            return f"model {self.name} (from the engine's {self.route}{also})"
        why = f" ({self.problem})" if self.problem else ""
        return f"model not known yet{why}: learned from the engine on the first call"

    async def start(self, lister: Lister) -> None:
        """Try a few times now; if that fails, keep trying in the background."""
        if self.name is not None:
            return
        for delay in START_DELAYS:
            if await self.learn(lister) is not None:
                return
            await asyncio.sleep(delay)
        if await self.learn(lister) is None:
            self._retry = asyncio.get_running_loop().create_task(self._keep_trying(lister))

    async def on_call(self, lister: Lister) -> str | None:
        """The name for a harness call: asks the engine on the first call only (later calls
        rely on the background retries, so an engine without `/v1/models` costs one GET)."""
        if self.name is not None or self._asked_on_call:
            return self.name
        self._asked_on_call = True
        return await self.learn(lister)

    async def learn(self, lister: Lister) -> str | None:
        """Ask the engine once (unless known); the name, or None with `problem` set."""
        if self.name is not None:
            return self.name
        async with self._lock:
            if self.name is not None:
                return self.name
            try:
                status, body = await lister()
            except Exception as exc:  # httpx transport errors of every kind
                self.problem = f"GET {self.route} failed: {type(exc).__name__}: {exc}"
                return None
            names = self.names(body) if status == 200 else []
            if not names:
                self.problem = f"GET {self.route} answered HTTP {status} without a model id"
                return None
            self.name, self.listed, self.source, self.problem = names[0], names, "engine", None
            if len(names) > 1:
                log.info("the engine serves %s; using %s", ", ".join(names), names[0])
            return self.name

    async def _keep_trying(self, lister: Lister) -> None:
        delay, waited = START_DELAYS[-1], 0.0
        while self.name is None and waited < RETRY_FOR:
            delay = min(delay * 2, RETRY_CAP)
            await asyncio.sleep(delay)
            waited += delay
            if await self.learn(lister) is not None:
                log.info("learned the served model name %s from the engine", self.name)

    async def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry
            self._retry = None

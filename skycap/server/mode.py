"""What a call mode does for the harness routes, and how a harness flow is answered.

A server runs in one mode, an object the gate hands each admitted call to: text mode
(`textmode`) forwards it upstream with skycap's own client and taps the reply; token mode
(`tokenmode`) renders it and answers from the engine. The gate and retry
de-duplication (`harness`) and the addon's lifecycle hooks only ever ask the mode.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from mitmproxy import http

from skycap.dialects import Dialect, Request
from skycap.dialects.chat import DIALECT as DEFAULT_DIALECT
from skycap.server import messages
from skycap.server.live import Live
from skycap.server.retry import CallKey, Entry
from skycap.server.store import TrajectoryStore


def respond(flow: http.HTTPFlow, status: int, body: bytes, headers: Any = messages.JSON) -> None:
    """Answer from a request hook; mitmproxy then contacts no upstream for this flow."""
    flow.response = messages.response(status, body, headers)


def harness_error(
    flow: http.HTTPFlow,
    status: int,
    message: str,
    code: str | None = None,
    dialect: Dialect = DEFAULT_DIALECT,
    param: str | None = None,
) -> None:
    """Answer with the error body the caller's SDK reads, in its dialect (docs/http.md)."""
    respond(flow, status, dialect.error(status, message, code, param))


class RunningCall(Protocol):
    """A call still running when its request hook returns; the response hooks finish it."""

    @property
    def relaying(self) -> bool:
        """Whether its reply reaches the harness from the loopback, passed on as it comes."""
        ...

    def harness_left(self) -> None: ...


class CallMode(Protocol):
    """One server's way of running calls; see the module docstring.

    `capture` is the record's capture block; `release` and `decode_spans` what the store
    hands an ended trajectory's tokens to (token mode), else None; `counters` the mode's
    own `/healthz` counters (token mode's render cache), else None. `renders` says whether
    skycap renders prompts itself (a dialect's `prepare` reads it).
    """

    capture: dict[str, Any]
    release: Callable[[str], Awaitable[None]] | None
    decode_spans: Callable[..., tuple[bytes, list[int]]] | None
    counters: Callable[[], dict[str, int]] | None
    renders: bool

    def provenance(self) -> dict[str, Any]:
        """The `provenance` of a trajectory created now (format.md §4)."""
        ...

    def attach(self, store: TrajectoryStore) -> None:
        """Built before the store (which records `capture`); given it before `start`."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def describe(self) -> str | None:
        """A line about this mode for the start banner of `skycap serve`, or None."""
        ...

    def refusal(self, proxied: bool) -> str | None:
        """Why this server cannot take a call at all (no upstream to forward it to), or None."""
        ...

    async def models(
        self, flow: http.HTTPFlow, live: Live, suffix: bytes, dialect: Dialect
    ) -> None: ...

    async def count_tokens(
        self, flow: http.HTTPFlow, live: Live, request: Request, suffix: bytes, dialect: Dialect
    ) -> None: ...

    async def stored_reply(
        self, flow: http.HTTPFlow, live: Live, reply_id: str, suffix: bytes, dialect: Dialect
    ) -> None: ...

    async def call(
        self, flow: http.HTTPFlow, live: Live, request: Request, entry: Entry, dialect: Dialect
    ) -> RunningCall | None: ...

    def join_running(
        self, flow: http.HTTPFlow, live: Live, key: CallKey, request: Request, dialect: Dialect
    ) -> bool:
        """A streamed retry of a call still running: True when the mode answers it here."""
        ...

    def harness_left(self, flow: http.HTTPFlow, forwarded: bool, dialect: Dialect) -> None:
        """mitmproxy gave up on a flow with no running call (`forwarded`: a model list,
        token count or stored reply this mode sent on)."""
        ...

"""Token mode's HTTP calls to the engine: generate (whole or streamed), abort, models, release.

One `httpx.AsyncClient` per backend, made on first use (so on the serving event loop), with
the engine's key as `Authorization: Bearer` when one is set. The engine wire
(skycap.tokens.engine.EngineWire) names the routes, headers and bodies and reads the
replies; this module only moves bytes and names transport failures.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson

from skycap.episodes import FailureEpisode
from skycap.tokens.engine import EngineError, EngineWire

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 30.0
RELEASE_TIMEOUT = 10.0
#: Characters of an engine's error body quoted in the harness's 502/5xx message.
ENGINE_EXCERPT_LIMIT = 300
#: Pauses before connecting again after a refused or reset connect (nothing was sent);
#: after the last, the call fails with 502 `engine: …` (docs/tokens.md "Outcomes the harness sees").
CONNECT_RETRY_DELAYS = (0.05, 0.25)


class EngineClient:
    """The HTTP calls to one engine root (`upstream_url`, e.g. http://engine:8000)."""

    def __init__(
        self,
        upstream_url: str,
        api_key: str | None,
        engine: EngineWire,
        upstream_timeout: float | None,
    ) -> None:
        self.upstream_url = upstream_url
        self.api_key = api_key
        self.engine = engine
        self.upstream_timeout = upstream_timeout
        self._client: httpx.AsyncClient | None = None
        # An engine that is down fails every call: one episode, not a line per call.
        self.unreachable = FailureEpisode(
            log, f"the engine at {upstream_url} cannot be reached (calls are answered 502)"
        )

    async def _connected[T](self, session_id: str, send: Callable[[], Awaitable[T]]) -> T:
        """`send()`, tried again when its connect failed (refused, reset: nothing was sent);
        a request whose bytes went out is never sent twice."""
        for delay in CONNECT_RETRY_DELAYS:
            try:
                answer = await send()
            except httpx.ConnectError:
                await asyncio.sleep(delay)
                continue
            self.unreachable.succeeded()
            return answer
        try:
            answer = await send()
        except httpx.ConnectError as exc:
            self.unreachable.failed(session_id, f"{type(exc).__name__}: {exc}")
            raise
        self.unreachable.succeeded()
        return answer

    async def generate(self, session_id: str, payload: bytes) -> tuple[int, bytes]:
        """POST the generate request: (status, body); transport failures raise EngineError."""
        url = self.upstream_url + self.engine.generate_path
        headers = self._generate_headers(session_id)
        try:
            response = await self._connected(
                session_id, lambda: self._http().post(url, content=payload, headers=headers)
            )
        except httpx.HTTPError as exc:
            raise self._transport_error(url, exc) from exc
        return response.status_code, response.content

    @asynccontextmanager
    async def stream(
        self, session_id: str, payload: bytes
    ) -> AsyncIterator[tuple[int, AsyncIterator[list[Any]] | bytes]]:
        """POST a streamed generate request: (status, its decoded `data:` chunks) on 200,
        else (status, the error body). The chunks come in batches, one per read from the
        socket (all the engine sent since the last read, so a reader that fell behind
        catches up in one step); they end at `data: [DONE]` or when the stream does.
        Transport failures, on connect or mid-stream, raise EngineError. Leaving the block
        closes the stream (vLLM aborts a request whose client went away).
        """
        url = self.upstream_url + self.engine.generate_path
        headers = self._generate_headers(session_id)
        request = self._http().build_request("POST", url, content=payload, headers=headers)
        try:
            response = await self._connected(
                session_id, lambda: self._http().send(request, stream=True)
            )
        except httpx.HTTPError as exc:
            raise self._transport_error(url, exc) from exc
        try:
            if response.status_code != 200:
                yield response.status_code, await response.aread()
            else:
                yield 200, self._batches(url, response)
        except httpx.HTTPError as exc:
            raise self._transport_error(url, exc) from exc
        finally:
            await response.aclose()

    async def _batches(self, url: str, response: httpx.Response) -> AsyncIterator[list[Any]]:
        """The `data:` chunks of each read, decoded; a line split across reads waits whole."""
        rest = b""
        try:
            async for data in response.aiter_bytes():
                *lines, rest = (rest + data).split(b"\n")
                batch, done = _data_chunks(lines)
                if batch:
                    yield batch
                if done:
                    return
            batch, _ = _data_chunks([rest])
            if batch:
                yield batch
        except httpx.HTTPError as exc:
            raise self._transport_error(url, exc) from exc

    def _generate_headers(self, session_id: str) -> dict[str, str]:
        return {
            "Content-Type": "application/json",
            **self.engine.session_headers(session_id),
            **self._auth(),
        }

    def _transport_error(self, url: str, exc: httpx.HTTPError) -> EngineError:
        if isinstance(exc, httpx.ConnectTimeout):
            return EngineError(f"could not connect to {url} within {CONNECT_TIMEOUT:g} s")
        if isinstance(exc, httpx.TimeoutException):
            return EngineError(f"timed out after {self.upstream_timeout:g} s")
        return EngineError(f"{type(exc).__name__} calling {url}: {exc}")

    async def abort(self, request_id: str) -> None:
        """Stop a streamed request inside the engine (best effort: the stream is closed too)."""
        route = self.engine.abort(request_id)
        if route is not None:
            await self._best_effort("abort", request_id, route[0], json=route[1])

    @property
    def models_url(self) -> str:
        return self.upstream_url + self.engine.models_path

    async def models(self, timeout: Any = httpx.USE_CLIENT_DEFAULT) -> httpx.Response:
        """GET the engine's model list; transport failures raise httpx errors."""
        return await self._http().get(self.models_url, headers=self._auth(), timeout=timeout)

    async def list_models(self) -> tuple[int, bytes]:
        """The model list briefly, for learning the served name: (status, body); transport
        failures raise httpx errors (skycap.tokens.models.ServedModel's lister)."""
        response = await self.models(timeout=CONNECT_TIMEOUT)
        return response.status_code, response.content

    async def engine_version(self) -> str | None:
        """The release the engine reports at its wire's `version_path` (vLLM's `/version`:
        `{"version": "0.33.0"}`), or None when the wire names no route or the engine does
        not answer it; recorded in each record's provenance."""
        path = getattr(self.engine, "version_path", None)
        if path is None:
            return None
        try:
            response = await self._http().get(
                self.upstream_url + path, headers=self._auth(), timeout=RELEASE_TIMEOUT
            )
            version = orjson.loads(response.content).get("version")
        except (httpx.HTTPError, orjson.JSONDecodeError, AttributeError) as exc:
            log.info("engine version: %s: %s", type(exc).__name__, exc)
            return None
        return version if response.status_code == 200 and isinstance(version, str) else None

    async def release(self, session_id: str) -> None:
        """Ask the engine to drop the session's state
        (best effort, docs/tokens.md "Engines and renderers")."""
        route = self.engine.release(session_id)
        if route is not None:
            await self._best_effort("release", session_id, route[0], params=route[1])

    async def _best_effort(self, what: str, subject: str, path: str, **request: Any) -> None:
        """POST to one of the engine's optional routes; a failure is one info line, no more."""
        try:
            response = await self._http().post(
                self.upstream_url + path, headers=self._auth(), timeout=RELEASE_TIMEOUT, **request
            )
        except httpx.HTTPError as exc:
            log.info("engine %s of %s failed: %s: %s", what, subject, type(exc).__name__, exc)
            return
        if response.status_code >= 400:
            log.info("engine %s of %s answered HTTP %s", what, subject, response.status_code)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(
                    connect=CONNECT_TIMEOUT,
                    read=self.upstream_timeout,
                    write=self.upstream_timeout,
                    pool=None,
                ),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        return self._client


def engine_status_message(status: int, body: str) -> str:
    """`engine returned HTTP <N>: <excerpt>` for the harness, so the cause is visible where
    the call failed (a 404 from a wrong --upstream-url, an engine's validation error).

    The excerpt is the body with whitespace collapsed, cut to ENGINE_EXCERPT_LIMIT
    characters; the failure entry keeps the body itself
    (docs/tokens.md "Outcomes the harness sees").
    """
    excerpt = " ".join(body.split())
    if len(excerpt) > ENGINE_EXCERPT_LIMIT:
        excerpt = excerpt[: ENGINE_EXCERPT_LIMIT - 1] + "…"
    message = f"engine returned HTTP {status}"
    return f"{message}: {excerpt}" if excerpt else message


def _data_chunks(lines: list[bytes]) -> tuple[list[Any], bool]:
    """The decoded `data:` payloads of these SSE lines, and whether `[DONE]` was among them
    (what follows it is ignored). Blank separators, comments and `event:` lines are skipped."""
    chunks: list[Any] = []
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return chunks, True
        try:
            chunks.append(orjson.loads(data))
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"a stream chunk is not JSON ({exc}): {data[:200]!r}") from exc
    return chunks, False

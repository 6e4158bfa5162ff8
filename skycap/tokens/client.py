"""Token mode's HTTP wire to the engine: the generate call, its model list and session release.

One `httpx.AsyncClient` per backend, made on first use (so on the serving event loop), with
the engine's key as `Authorization: Bearer` when one is set. The backend decides what a
reply means; this module only moves bytes and names transport failures.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from skycap.tokens.engine import EngineError, VLLMEngine

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 30.0
RELEASE_TIMEOUT = 10.0
#: Characters of an engine's error body quoted in the harness's 502/5xx message.
ENGINE_EXCERPT_LIMIT = 300


class EngineClient:
    """The HTTP calls to one engine root (`upstream_url`, e.g. http://engine:8000)."""

    def __init__(
        self,
        upstream_url: str,
        api_key: str | None,
        engine: VLLMEngine,
        upstream_timeout: float | None,
    ) -> None:
        self.upstream_url = upstream_url
        self.api_key = api_key
        self.engine = engine
        self.upstream_timeout = upstream_timeout
        self._client: httpx.AsyncClient | None = None

    async def generate(self, session_id: str, payload: bytes) -> tuple[int, bytes]:
        """POST the generate request: (status, body); transport failures raise EngineError."""
        url = self.upstream_url + self.engine.generate_path
        headers = {"Content-Type": "application/json", "X-Session-ID": session_id, **self._auth()}
        try:
            response = await self._http().post(url, content=payload, headers=headers)
        except httpx.ConnectTimeout as exc:
            raise EngineError(f"could not connect to {url} within {CONNECT_TIMEOUT:g} s") from exc
        except httpx.TimeoutException as exc:
            raise EngineError(f"timed out after {self.upstream_timeout:g} s") from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"{type(exc).__name__} calling {url}: {exc}") from exc
        return response.status_code, response.content

    @property
    def models_url(self) -> str:
        return self.upstream_url + "/v1/models"

    async def models(self, timeout: Any = httpx.USE_CLIENT_DEFAULT) -> httpx.Response:
        """GET the engine's `/v1/models`; transport failures raise httpx errors."""
        return await self._http().get(self.models_url, headers=self._auth(), timeout=timeout)

    async def release(self, session_id: str) -> None:
        """Ask the engine to drop the session's state (best effort, http.md §11)."""
        if not self.engine.release_path:
            return
        url = self.upstream_url + self.engine.release_path
        try:
            response = await self._http().post(
                url,
                params={"session_id": session_id},
                headers=self._auth(),
                timeout=RELEASE_TIMEOUT,
            )
        except httpx.HTTPError as exc:
            log.info("engine release of %s failed: %s: %s", session_id, type(exc).__name__, exc)
            return
        if response.status_code >= 400:
            log.info("engine release of %s answered HTTP %s", session_id, response.status_code)

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
    characters; the failure entry keeps the body itself (http.md §9.8).
    """
    excerpt = " ".join(body.split())
    if len(excerpt) > ENGINE_EXCERPT_LIMIT:
        excerpt = excerpt[: ENGINE_EXCERPT_LIMIT - 1] + "…"
    message = f"engine returned HTTP {status}"
    return f"{message}: {excerpt}" if excerpt else message

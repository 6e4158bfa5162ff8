"""Trainer-side async client for capture servers: CapturePool, Trajectory handles and results."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import httpx
import numpy as np

from skycap.arrays import unpack
from skycap.control_token import ENV as CONTROL_TOKEN_ENV
from skycap.control_token import find_control_token

__all__ = [
    "CaptureError",
    "CapturePool",
    "FinishResult",
    "Media",
    "PathRuleError",
    "RecordLocation",
    "Sample",
    "Trajectory",
]

logger = logging.getLogger("skycap.client")


class CaptureError(Exception):
    """A server answered non-200 or badly, or was unreachable (then status is None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class PathRuleError(CaptureError):
    """The finish's path rule failed; the trajectory is ended and written without samples."""


@dataclass(frozen=True)
class RecordLocation:
    """Where a finished trajectory's record lives (http.md §2.3)."""

    path: str
    mirror: str | None = None
    files: tuple[str, ...] = ()
    host: str | None = None
    # The mirror copy at finish time: pending, copied, excluded (copied without the
    # excluded sidecar kinds) or failed (with mirror_error); None without a mirror.
    mirror_state: str | None = None
    mirror_error: str | None = None

    @property
    def local(self) -> str:
        """`host:path` scp style, so it can be pasted into scp/rsync; IPv6 hosts are bracketed."""
        if not self.host:
            return self.path
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.path}"

    @property
    def uri(self) -> str:
        return self.mirror or self.local

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | None) -> RecordLocation | None:
        if obj is None:
            return None
        return cls(
            path=_field(obj, "path", str),
            mirror=_field(obj, "mirror", str, optional=True),
            files=tuple(_field(obj, "files", list, optional=True) or ()),
            host=_field(obj, "host", str, optional=True),
            mirror_state=_field(obj, "mirror_state", str, optional=True),
            mirror_error=_field(obj, "mirror_error", str, optional=True),
        )


@dataclass
class Media:
    """An image placed in a sample's input_ids, with its processor arrays when sent."""

    modality: str
    offset: int
    length: int
    hash: str
    data: dict[str, np.ndarray] | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Media:
        data = _field(obj, "data", dict, optional=True)
        return cls(
            modality=_field(obj, "modality", str),
            offset=_field(obj, "offset", int),
            length=_field(obj, "length", int),
            hash=_field(obj, "hash", str),
            data=None if data is None else {name: unpack(env) for name, env in data.items()},
        )


@dataclass
class Sample:
    """One training row; token fields are None for text-mode samples (plain lists, numpy only for
    routed experts)."""

    leaf: int
    path: list[int]
    messages: list[dict[str, Any]]
    targets: list[int]
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    logprobs: list[float] | None = None
    routed_experts: np.ndarray | None = None
    sampling_mask: list[list[int]] | None = None
    media: list[Media] = field(default_factory=list)
    #: `[{"version", "start", "end"}]` over this sample's positions: which weight version
    #: sampled each trained token (only trained positions are covered); None when the
    #: engine reported none (docs/trainer.md "Policy versions").
    weight_versions: list[dict[str, Any]] | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Sample:
        """Decode the finish wire (graph.md §5): envelopes into arrays, CSR into row lists."""
        if not isinstance(obj, Mapping):
            raise ValueError(f"invalid sample: expected an object, got {type(obj).__name__}")
        input_ids = _field(obj, "input_ids", list, optional=True)
        logprobs = _field(obj, "logprobs", list, optional=True)
        experts = obj.get("routed_experts")
        mask = _field(obj, "sampling_mask", dict, optional=True)
        return cls(
            leaf=_field(obj, "leaf", int),
            path=_field(obj, "path", list),
            messages=_field(obj, "messages", list),
            targets=_field(obj, "targets", list),
            input_ids=input_ids,
            loss_mask=_field(obj, "loss_mask", list, optional=True),
            logprobs=None if logprobs is None else [float(x) for x in logprobs],
            routed_experts=None if experts is None else unpack(experts),
            sampling_mask=None if mask is None else _csr_rows(mask, input_ids),
            media=[Media.from_json(m) for m in _field(obj, "media", list, optional=True) or []],
            weight_versions=_field(obj, "weight_versions", list, optional=True),
        )


@dataclass
class FinishResult:
    """A finish reply; check `status` before training (samples come for every status)."""

    id: str
    status: str
    samples: list[Sample]
    unbridged_calls: int = 0
    record: RecordLocation | None = None
    context_length_exceeded: bool = False
    #: Committed model calls; 0 means nothing was captured (see `warnings`).
    calls: int = 0
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> FinishResult:
        if not isinstance(obj, Mapping):
            raise ValueError(f"invalid finish reply: expected an object, got {type(obj).__name__}")
        return cls(
            id=_field(obj, "id", str),
            status=_field(obj, "status", str),
            samples=[Sample.from_json(s) for s in _field(obj, "samples", list)],
            unbridged_calls=_field(obj, "unbridged_calls", int, optional=True) or 0,
            record=RecordLocation.from_json(_field(obj, "record", dict, optional=True)),
            context_length_exceeded=bool(obj.get("context_length_exceeded", False)),
            calls=_field(obj, "calls", int, optional=True) or 0,
            warnings=[str(w) for w in _field(obj, "warnings", list, optional=True) or ()],
        )


def _field(obj: Mapping[str, Any], key: str, kind: type, *, optional: bool = False) -> Any:
    """Typed lookup so a malformed reply fails with the key's name, not deep in trainer code."""
    value = obj.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"invalid reply: `{key}` must be {kind.__name__}, got {value!r:.80}")
    return value


def _csr_rows(csr: Mapping[str, Any], input_ids: list[int] | None) -> list[list[int]]:
    """CSR into one row per position; the bounds are checked so a bad reply cannot misalign rows."""
    ids, offsets = _field(csr, "ids", list), _field(csr, "offsets", list)
    if input_ids is None or len(offsets) != len(input_ids) + 1:
        raise ValueError(
            f"invalid sampling_mask CSR: {len(offsets)} offsets for "
            f"{None if input_ids is None else len(input_ids)} input_ids (needs one more)"
        )
    if (
        offsets[0] != 0
        or offsets[-1] != len(ids)
        or not all(type(a) is int and a <= b for a, b in pairwise(offsets))
    ):
        raise ValueError("invalid sampling_mask CSR: offsets must rise from 0 to len(ids)")
    return [ids[offsets[r] : offsets[r + 1]] for r in range(len(input_ids))]


def _encode(what: str, value: Any) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON-serialisable (no NaN/inf): {exc}") from exc


#: The key a trajectory's harness sends when its server issued none: servers from before
#: trajectory keys answer create without `api_key` and accept any key, while the SDKs
#: refuse to start without one.
KEYLESS_API_KEY = "sk-skycap-keyless"


@dataclass(eq=False)
class Trajectory:
    """Handle on one trajectory; it lives on one server, with no failover after create."""

    _pool: CapturePool = field(repr=False)
    server: str
    id: str
    base_url: str
    api_key: str = field(repr=False)
    exposed_base_url: str | None = None
    #: The base URL without `/v1`, for Anthropic clients (`ANTHROPIC_BASE_URL`).
    anthropic_base_url: str | None = None
    #: Proxy mode (`--proxy-port`): the credentialed proxy URL, and the environment to add to
    #: a harness subprocess so its calls to any API host are captured (docs/proxy.md).
    proxy_url: str | None = field(default=None, repr=False)
    env: dict[str, str] | None = field(default=None, repr=False)
    paths: str = "all"
    result: FinishResult | None = None
    finishing: dict[str, Any] | None = None
    _finishing_paths: str | None = field(default=None, repr=False)

    async def finish(
        self, annotations: Mapping[str, Any] | None = None, *, paths: str | None = None
    ) -> FinishResult:
        """End the trajectory and get its samples; safe to repeat (the server answers alike)."""
        self.finishing = dict(annotations or {})
        self._finishing_paths = paths or self.paths
        body = {"annotations": self.finishing, "paths": self._finishing_paths}
        url = f"{self.server}/trajectories/{self.id}/finish"
        try:
            reply = await self._pool._request("POST", url, _encode("annotations", body))
        except CaptureError as exc:
            if exc.status in (404, 410):  # the server no longer holds it: not open any more
                self._pool._forget(self.server, self.id)
            raise
        self._pool._forget(self.server, self.id)
        try:
            result = FinishResult.from_json(reply)
        except ValueError as exc:
            raise CaptureError(f"POST {url}: malformed finish reply: {exc}", 200) from exc
        if self.result is None:
            self.result = result
        return result

    async def record(self) -> RecordLocation:
        """Where the written record is now, its mirror copy's state included (the finish
        answer's `record` is taken at finish time); CaptureError 404 before it is written."""
        url = f"{self.server}/trajectories/{self.id}/record"
        reply = await self._pool._request("GET", url)
        try:
            location = RecordLocation.from_json(reply)
        except (ValueError, TypeError, AttributeError) as exc:
            raise CaptureError(f"GET {url}: malformed record reply: {exc}", 200) from exc
        if location is None:
            raise CaptureError(f"GET {url}: expected a JSON object, got null", 200)
        return location

    async def document(self) -> dict[str, Any]:
        url = f"{self.server}/trajectories/{self.id}"
        reply = await self._pool._request("GET", url)
        if not isinstance(reply, dict):
            raise CaptureError(f"GET {url}: expected a JSON object, got {reply!r:.200}", 200)
        return reply


class CapturePool:
    """Round-robin client for capture servers; one httpx client at a time, bound to its loop.

    Control calls carry the servers' control token: `control_token` when given, else
    for each server the one `skycap.control_token.find_control_token` finds (a CaptureService
    in this process, `SKYCAP_CONTROL_TOKEN`, or the file `skycap serve` wrote on this machine).

    The pool remembers which trajectories it created on each server and has not finished
    (`open_trajectories()`), so when a server dies its losses can be named by id.
    """

    def __init__(
        self, urls: list[str], *, timeout: float = 60.0, control_token: str | None = None
    ) -> None:
        if isinstance(urls, str) or not urls:
            raise ValueError(f"CapturePool needs a non-empty list of server URLs, got {urls!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self.control_token = control_token
        # A random start spreads the load of many independent pools over the servers.
        self._next = random.randrange(len(self.urls))
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._open: dict[str, dict[str, None]] = {url: {} for url in self.urls}

    async def __aenter__(self) -> CapturePool:
        self._check_open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def create(
        self, meta: Mapping[str, Any] | None = None, *, paths: str = "all"
    ) -> Trajectory:
        """Try each server once; unreachable, timed-out and 5xx servers are skipped."""
        self._check_open()
        body = _encode("meta", {"meta": dict(meta or {})})
        start, n = self._next, len(self.urls)
        self._next = (start + 1) % n
        reasons: list[str] = []
        last: CaptureError | None = None
        for server in self.urls[start:] + self.urls[:start]:
            try:
                reply = await self._request("POST", f"{server}/trajectories", body)
            except CaptureError as exc:
                if exc.status is not None and exc.status < 500:
                    raise
                reasons.append(exc.message)
                last = exc
                continue
            trajectory = self._handle(server, reply, paths)
            with self._lock:
                self._open.setdefault(server, {})[trajectory.id] = None
            return trajectory
        raise CaptureError(f"no capture server reachable: {'; '.join(reasons)}") from last

    @contextlib.asynccontextmanager
    async def trajectory(
        self, meta: Mapping[str, Any] | None = None, *, paths: str = "all"
    ) -> AsyncIterator[Trajectory]:
        """Create a trajectory and make sure it is finished however the block ends.

        A leftover finish repeats the last attempted one's paths too, so it cannot trip the
        server's "already finished with paths=…" 409 after a recorded rule.
        """
        traj = await self.create(meta, paths=paths)
        try:
            yield traj
        except BaseException as exc:
            if traj.result is None:
                fallback = {"error": type(exc).__name__}
                annotations = traj.finishing if traj.finishing is not None else fallback
                try:
                    await traj.finish(annotations, paths=traj._finishing_paths)
                except Exception as finish_exc:
                    logger.info("finishing %s after %r failed: %s", traj.id, exc, finish_exc)
            raise
        if traj.result is None:
            await traj.finish({}, paths=traj._finishing_paths)

    def open_trajectories(self) -> dict[str, list[str]]:
        """Per server URL, the ids this pool created there and has not finished, oldest first."""
        with self._lock:
            return {server: list(ids) for server, ids in self._open.items()}

    def replace_server(self, old: str, new: str | None) -> list[str]:
        """Take server `old` out of the rotation (putting `new` in its place, if given).

        Returns the ids of the trajectories this pool had open on `old`: they are lost with
        it. `skycap.ray.CaptureServers` calls this when it replaces a dead actor.
        """
        old, new = old.rstrip("/"), None if new is None else new.rstrip("/")
        with self._lock:
            if old not in self.urls:
                return []
            index = self.urls.index(old)
            if new is None:
                if len(self.urls) == 1:
                    raise ValueError(f"cannot remove {old}: it is the pool's only server")
                del self.urls[index]
            else:
                self.urls[index] = new
                self._open.setdefault(new, {})
            self._next %= len(self.urls)
            return list(self._open.pop(old, {}))

    def _forget(self, server: str, trajectory_id: str) -> None:
        with self._lock:
            self._open.get(server, {}).pop(trajectory_id, None)

    async def close(self) -> None:
        """Close the HTTP client, also from a loop other than the one that created it."""
        with self._lock:
            self._closed = True
            client, loop, self._client, self._loop = self._client, self._loop, None, None
        if client is None:
            return
        if loop is asyncio.get_running_loop():
            await client.aclose()
        elif loop is not None and loop.is_running():
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(client.aclose(), loop))
        # Else its loop is gone: its sockets cannot be closed from here and go with the GC.

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the CapturePool is closed")

    def _http(self) -> httpx.AsyncClient:
        """The client for the running loop, made anew when the loop changed.

        The old client is dropped, not closed: its loop owns its sockets (and may still be
        running requests in another thread); the garbage collector closes them.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            self._check_open()
            if self._client is None or self._loop is not loop:
                self._client, self._loop = httpx.AsyncClient(timeout=self.timeout), loop
            return self._client

    async def _request(self, method: str, url: str, content: bytes | None = None) -> Any:
        """One HTTP exchange; every failure becomes a CaptureError (status None if no answer)."""
        client = self._http()
        headers = {"content-type": "application/json"} if content is not None else {}
        token = self.control_token if self.control_token is not None else find_control_token(url)
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        try:
            async with asyncio.timeout(self.timeout):
                resp = await client.request(method, url, content=content, headers=headers)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise CaptureError(
                f"{method} {url}: no reply within {self.timeout} s; check the server or raise "
                "CapturePool(timeout=...)"
            ) from exc
        except httpx.TransportError as exc:
            raise CaptureError(
                f"{method} {url}: cannot reach the capture server "
                f"({type(exc).__name__}: {exc or 'no detail'})"
            ) from exc
        if resp.status_code != 200:
            raise _http_error(method, url, resp, token_sent=token is not None)
        try:
            return resp.json()
        except ValueError as exc:
            raise CaptureError(
                f"{method} {url}: reply is not JSON: {resp.text[:200]!r}", 200
            ) from exc

    def _handle(self, server: str, reply: Any, paths: str) -> Trajectory:
        url = f"{server}/trajectories"
        try:
            if not isinstance(reply, Mapping):
                raise ValueError(f"expected an object, got {type(reply).__name__}")
            return Trajectory(
                self,
                server=server,
                id=_field(reply, "id", str),
                base_url=_field(reply, "base_url", str),
                api_key=_field(reply, "api_key", str, optional=True) or KEYLESS_API_KEY,
                exposed_base_url=_field(reply, "exposed_base_url", str, optional=True),
                anthropic_base_url=_field(reply, "anthropic_base_url", str, optional=True),
                proxy_url=_field(reply, "proxy_url", str, optional=True),
                env=_field(reply, "env", dict, optional=True),
                paths=paths,
            )
        except ValueError as exc:
            raise CaptureError(f"POST {url}: malformed create reply: {exc}", 200) from exc


def _http_error(method: str, url: str, resp: httpx.Response, *, token_sent: bool) -> CaptureError:
    """Bodies are parsed as JSON whatever their content type; `code` picks PathRuleError."""
    text = resp.text
    message = f"{method} {url}: HTTP {resp.status_code}: {text[:2000]}"
    if resp.status_code == 401 and not token_sent:
        message += (
            f"; no control token was found for this server: pass CapturePool(..., "
            f"control_token=...) or set {CONTROL_TOKEN_ENV}"
        )
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("code") == "path_rule_failed":
        return PathRuleError(message, resp.status_code)
    return CaptureError(message, resp.status_code)

"""Shared helpers for the server tests: a capture server on its own thread, a mock upstream."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from skycap.mock.upstream import ScriptedUpstream
from skycap.server.options import ServerOptions


class ServerThread:
    """`skycap.server.runner.serve` on a daemon thread with its own loop, as an embedder runs it."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.url = ""
        self.addon: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> str:
        from skycap.server.addon import SkycapAddon

        ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        self.addon = SkycapAddon(self.options)

        async def main() -> None:
            from skycap.server.runner import serve

            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve(
                self.options, ready=ready.set_result, stop_event=self._stop, addons=[self.addon]
            )

        def target() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:  # reported by start() or stop()
                self._error = exc
                if not ready.done():
                    ready.set_exception(exc)

        self._thread = threading.Thread(target=target, name="skycap-test-server", daemon=True)
        self._thread.start()
        self.url = ready.result(timeout=20)
        return self.url

    @property
    def store(self) -> Any:
        return self.addon.store

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the server loop (the store is loop-owned) and return its result."""
        assert self._loop is not None
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future.result(timeout=10)

    def run(self, coro_fn: Callable[[], Any]) -> Any:
        """Await `coro_fn()` on the server loop and return its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(timeout=30)

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the capture server did not stop within 30 s"
        self._thread = None
        if self._error is not None:
            raise self._error


def wait_for(condition: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """Poll `condition` until truthy (state changes on other threads); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    mock = ScriptedUpstream()
    mock.start()
    yield mock
    mock.stop()


@pytest.fixture
def make_server(upstream: ScriptedUpstream) -> Iterator[Callable[..., ServerThread]]:
    """Start servers with options over the mock upstream; all are stopped at teardown."""
    started: list[ServerThread] = []

    def make(**kwargs: Any) -> ServerThread:
        kwargs.setdefault("upstream_url", upstream.base_url)
        server = ServerThread(ServerOptions(**kwargs))
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


class Control:
    """A tiny control-plane client (the trainer side) over httpx, returning parsed JSON."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=20)

    def create(self, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self.http.post("/trajectories", json={"meta": meta or {}})
        assert response.status_code == 200, response.text
        return response.json()

    def finish(self, trajectory_id: str, **body: Any) -> httpx.Response:
        return self.http.post(f"/trajectories/{trajectory_id}/finish", json=body)

    def document(self, trajectory_id: str) -> httpx.Response:
        return self.http.get(f"/trajectories/{trajectory_id}")

    def close(self) -> None:
        self.http.close()


def record_files(record_dir: Path) -> list[str]:
    return sorted(p.name for p in record_dir.iterdir() if p.name.endswith(".json.zst"))

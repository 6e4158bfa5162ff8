"""Shared helpers for the server tests: a capture server on its own thread, a mock upstream."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
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


# -- the HTTPS_PROXY listener (tests/test_proxy_*.py) ------------------------------------------

# A hard-coded harness: the unchanged SDK with no base URL (https://api.openai.com/v1), so
# only the environment (HTTPS_PROXY, SSL_CERT_FILE, NO_PROXY) brings it to skycap. Turn 1 is
# non-streamed, turn 2 streamed; it prints what it saw as one JSON line.
HARNESS = r"""
import json, openai
client = openai.OpenAI(api_key="sk-harness-own-key", max_retries=0, timeout=30)
tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
messages = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "go"}]
reply = client.chat.completions.create(model="policy", messages=messages, tools=tools)
message = reply.choices[0].message.model_dump(exclude_none=True)
messages.append(message)
for call in message.get("tool_calls") or ():
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "found"})
if not message.get("tool_calls"):
    messages.append({"role": "user", "content": "and then?"})
chunks = list(client.chat.completions.create(model="policy", messages=messages, stream=True))
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
models = [m.id for m in client.models.list()]
print(json.dumps({"first": message, "streamed": streamed, "models": models}))
"""


@pytest.fixture(scope="session")
def proxy_confdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CA per test session, never the user's own config dir."""
    return tmp_path_factory.mktemp("skycap-confdir")


def harness_env(created: dict[str, Any]) -> dict[str, str]:
    """This process's environment with the `env` a create returned, and nothing else proxied."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.lower().endswith("_proxy") and not key.startswith("OPENAI_")
    }
    env.update(created["env"])
    return env


def run_harness(created: dict[str, Any], script: str = HARNESS) -> dict[str, Any]:
    """Run `script` in a subprocess configured only by the create's `env`; its JSON output."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=harness_env(created),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def raw_connect(port: int, authorization: str | None) -> tuple[str, dict[str, str], bytes]:
    """Send one CONNECT to the proxy listener; (status line, headers, body) of its answer."""
    lines = ["CONNECT api.openai.com:443 HTTP/1.1", "Host: api.openai.com:443"]
    if authorization is not None:
        lines.append(f"Proxy-Authorization: {authorization}")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the proxy closed the connection after {data!r}"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status, *fields = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
        while len(body) < int(headers.get("content-length", "0")):
            chunk = sock.recv(65536)
            assert chunk, "the proxy closed the connection mid-body"
            body += chunk
    return status, headers, body


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

"""Shared helpers for the server tests: an embedded capture server, a mock upstream, clients."""

from __future__ import annotations

import base64
import dataclasses
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

from skycap import CaptureService
from skycap.control_token import find_control_token
from skycap.mock.engine import Reply
from skycap.mock.upstream import ScriptedUpstream
from skycap.server.options import ServerOptions


class ServerThread(CaptureService):
    """The embedded CaptureService, built from a ready ServerOptions.

    Every server test runs its server through here, so the embedding path is the one
    under test. `stop()` fails the test when the thread did not finish or the server
    ended with an error.
    """

    def __init__(self, options: ServerOptions) -> None:
        fields = dataclasses.fields(options)
        super().__init__(**{f.name: getattr(options, f.name) for f in fields if f.init})

    @property
    def store(self) -> Any:
        """The addon's trajectory store; touch it only through `run_in_loop`."""
        return self.server.store

    def stop(self, timeout: float = 30.0) -> bool:
        assert super().stop(timeout), f"the capture server did not stop within {timeout:g} s"
        if self._error is not None:
            raise self._error
        return True


class TextScript:
    """A scripted policy for `ScriptedEngine`: `text(prompt)` is what it samples (the engine
    encodes it and appends <|im_end|>); `completion(prompt)` gives back those exact ids, for
    checking what a record holds."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tool_response = tokenizer.convert_tokens_to_ids("<tool_response>")
        self.stop = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def text(self, prompt: list[int]) -> str:
        raise NotImplementedError

    def __call__(self, body: dict[str, Any]) -> Reply:
        return Reply(self.text(body["token_ids"]))

    def completion(self, prompt: list[int]) -> list[int]:
        return self.tokenizer.encode(self.text(prompt), add_special_tokens=False) + [self.stop]


def anthropic_sdk(created: dict[str, Any]) -> Any:
    """The unchanged anthropic SDK at a trajectory's Anthropic base URL."""
    import anthropic

    return anthropic.Anthropic(
        base_url=created["anthropic_base_url"], api_key=created["api_key"], max_retries=0
    )


def replayed_message(message: Any) -> dict[str, Any]:
    """The assistant turn a harness sends back: the SDK's content blocks as returned."""
    return {"role": "assistant", "content": [block.model_dump() for block in message.content]}


def stderr_to_exit(process: subprocess.Popen, timeout: float) -> str:
    """What `process` writes to its stderr pipe until it exits, with what the pipe's reader
    already holds. `communicate()` reads the pipe's descriptor itself, so lines an earlier
    `readline()` had already taken into the reader's buffer (a server's warnings written
    right after its start lines, read with them when the reader lagged) would be lost."""
    assert process.stderr is not None
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.append(process.stderr.read()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        raise subprocess.TimeoutExpired(process.args, timeout)
    process.wait(timeout=timeout)
    return read[0]


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
    with ScriptedUpstream() as mock:
        yield mock


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
    """A tiny control-plane client (the trainer side) over httpx, returning parsed JSON.

    It sends the control token it is given, else the one a client finds for `url` (the
    embedded server's, by its URL), as CapturePool does.
    """

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        token = token or find_control_token(url)
        headers = {"authorization": f"Bearer {token}"} if token else None
        self.http = httpx.Client(base_url=url, timeout=20, headers=headers)

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

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def bearer(token: str | None) -> dict[str, str]:
    """The `Authorization` header that carries a control token (none when it is off)."""
    return {"authorization": f"Bearer {token}"} if token else {}


@pytest.fixture
def control(server: ServerThread) -> Iterator[Control]:
    """A control client of the module's `server` fixture."""
    with Control(server.url) as client:
        yield client


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


def run_harness(
    created: dict[str, Any], script: str = HARNESS, timeout: float = 60
) -> dict[str, Any]:
    """Run `script` in a subprocess configured only by the create's `env`; its JSON output."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=harness_env(created),
        capture_output=True,
        text=True,
        timeout=timeout,
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

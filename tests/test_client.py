"""Tests of the trainer-side client against a fake control server on real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np
import pytest

import skycap.client as client_module
from skycap.arrays import PackedArrayError, pack
from skycap.client import (
    KEYLESS_API_KEY,
    CaptureError,
    CapturePool,
    FinishResult,
    PathRuleError,
    RecordLocation,
    Sample,
)

HANG = "hang"
PIXELS = np.arange(6, dtype=np.float32).reshape(2, 3)
# graph.md §5's example sample, verbatim, plus one image.
TOKEN_SAMPLE = {
    "leaf": 1,
    "path": [0, 1],
    "messages": [{"role": "user", "content": "qé"}, {"role": "assistant", "content": "🙂ok"}],
    "targets": [1],
    "input_ids": [1, 2, 3, 4, 5, 6, 7],
    "loss_mask": [0, 0, 0, 0, 1, 1, 1],
    "logprobs": [0.0, 0.0, 0.0, 0.0, -0.5, -0.25, -1],
    "routed_experts": {
        "data": "AAAAAAEBAQECAgICAwMDAwQEBAQFBQUFBQUFBQ==",
        "shape": [7, 2, 2],
        "dtype": "uint8",
    },
    "sampling_mask": {"ids": [5, 8, 6, 7, 1, 2], "offsets": [0, 0, 0, 0, 0, 2, 3, 6]},
    "media": [
        {
            "modality": "image",
            "offset": 1,
            "length": 2,
            "hash": "ab12",
            "data": {"pv": pack(PIXELS)},
        }
    ],
}
TEXT_SAMPLE = {"leaf": 3, "path": [2, 3], "messages": [{"role": "user"}], "targets": [3]}
RECORD = {
    "host": "fd00::5",
    "path": "/data/rec/tr_1.json.zst",
    "mirror": None,
    "files": ["tr_1.json.zst"],
}


class FakeServer:
    """A control server whose answers per route ("create", "finish", "get") can be overridden."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.overrides: dict[str, list[Any]] = {}
        self.release = threading.Event()
        self.count = 0
        self.keep_alive = True
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, so clients hold loop-bound connections

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                fake.handle(self, json.loads(self.rfile.read(length) or b"null"))

            def do_GET(self) -> None:
                fake.handle(self, None)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()

    def override(self, route: str, answer: Any, times: int = 1) -> None:
        """answer: (status, body) or HANG; served `times` times before the default comes back."""
        self.overrides.setdefault(route, []).extend([answer] * times)

    def routed(self, route: str) -> list[Any]:
        return [body for _, r, body in self.requests if r == route]

    def handle(self, handler: BaseHTTPRequestHandler, body: Any) -> None:
        parts = handler.path.strip("/").split("/")
        route = {1: "create", 3: "finish"}.get(len(parts), "get")
        self.requests.append((handler.command, route, body))
        queue = self.overrides.get(route)
        answer = queue.pop(0) if queue else self.default(route, parts)
        if answer == HANG:
            self.release.wait(5)
            return
        status, payload = answer
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        try:
            handler.send_response(status)
            handler.send_header("content-length", str(len(raw)))
            if not self.keep_alive:
                handler.send_header("connection", "close")
            handler.end_headers()
            handler.wfile.write(raw)
        except OSError:
            pass

    def default(self, route: str, parts: list[str]) -> tuple[int, Any]:
        if route == "create":
            self.count += 1
            tid = f"tr_{self.count:016x}"
            base = f"{self.url}/t/{tid}/v1"
            return 200, {"id": tid, "base_url": base, "api_key": "sk-skycap-k"}
        if route == "finish":
            samples = [TOKEN_SAMPLE, TEXT_SAMPLE]
            reply = {"id": parts[1], "status": "finished", "samples": samples, "record": RECORD}
            return 200, reply
        return 200, {"id": parts[1], "status": "open"}

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    made = [FakeServer(), FakeServer()]
    yield made
    for server in made:
        if server.thread.is_alive():
            server.stop()


@pytest.fixture
def server(servers: list[FakeServer]) -> FakeServer:
    return servers[0]


@pytest.fixture
def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def start_at(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pins the pool's random start to the last index in the returned list (0 unless appended)."""
    chosen = [0]
    monkeypatch.setattr(client_module.random, "randrange", lambda n: chosen[-1])
    return chosen


async def test_round_robin_from_random_start(
    servers: list[FakeServer], start_at: list[int]
) -> None:
    start_at.append(1)
    async with CapturePool([servers[0].url, servers[1].url + "/"]) as pool:
        used = [(await pool.create()).server for _ in range(3)]
    assert used == [servers[1].url, servers[0].url, servers[1].url]


async def test_random_start_varies_between_pools(servers: list[FakeServer]) -> None:
    urls = [servers[0].url, servers[1].url]
    starts = {CapturePool(urls)._next for _ in range(64)}
    assert starts == {0, 1}


async def test_create_skips_dead_5xx_and_hung_servers(
    servers: list[FakeServer], dead_url: str, start_at: list[int]
) -> None:
    sick, hung, ok = servers[0], servers[1], FakeServer()
    try:
        sick.override("create", (503, {"error": "overloaded"}))
        hung.override("create", HANG)
        async with CapturePool([dead_url, sick.url, hung.url, ok.url], timeout=0.5) as pool:
            traj = await pool.create({"task": "t1"})
        assert traj.server == ok.url
        assert traj.base_url == f"{ok.url}/t/{traj.id}/v1" and traj.api_key == "sk-skycap-k"
        assert ok.routed("create") == [{"meta": {"task": "t1"}}]
        assert len(sick.routed("create")) == 1 and len(hung.routed("create")) == 1
    finally:
        ok.stop()


async def test_all_servers_failing_lists_every_reason(
    server: FakeServer, dead_url: str, start_at: list[int]
) -> None:
    server.override("create", (500, {"error": "boom"}))
    async with CapturePool([dead_url, server.url]) as pool:
        with pytest.raises(CaptureError) as info:
            await pool.create()
    message = str(info.value)
    assert message.startswith("no capture server reachable: ")
    assert f"POST {dead_url}/trajectories: cannot reach" in message
    assert f'POST {server.url}/trajectories: HTTP 500: {{"error": "boom"}}' in message
    assert info.value.status is None


async def test_client_error_on_create_is_not_skipped(
    servers: list[FakeServer], start_at: list[int]
) -> None:
    servers[0].override("create", (400, b"`meta` must be an object"))
    async with CapturePool([s.url for s in servers]) as pool:
        with pytest.raises(CaptureError) as info:
            await pool.create()
    assert info.value.status == 400
    assert (
        str(info.value) == f"POST {servers[0].url}/trajectories: HTTP 400: `meta` must be an object"
    )
    assert servers[1].requests == []


async def test_error_body_is_cut_at_2000_characters(server: FakeServer) -> None:
    server.override("finish", (409, b"x" * 5000))
    async with CapturePool([server.url]) as pool:
        traj = await pool.create()
        with pytest.raises(CaptureError) as info:
            await traj.finish({"reward": 1})
    assert info.value.status == 409 and not isinstance(info.value, PathRuleError)
    assert str(info.value).endswith(": HTTP 409: " + "x" * 2000)


async def test_a_create_answer_without_api_key_is_accepted(server: FakeServer) -> None:
    """Servers from before trajectory keys answer create without `api_key` and take any key."""
    tid = "tr_00000000000000aa"
    server.override("create", (200, {"id": tid, "base_url": f"{server.url}/t/{tid}/v1"}))
    async with CapturePool([server.url]) as pool:
        async with pool.trajectory({"task": "t1"}) as trajectory:
            assert trajectory.api_key == KEYLESS_API_KEY
            result = await trajectory.finish({"reward": 1.0})
    assert result.status == "finished"


async def test_path_rule_error(server: FakeServer) -> None:
    body = {"error": "path rule 'mine' failed: KeyError: 3", "code": "path_rule_failed"}
    server.override("finish", (500, body))
    async with CapturePool([server.url]) as pool:
        traj = await pool.create()
        with pytest.raises(PathRuleError) as info:
            await traj.finish(paths="mine")
    assert isinstance(info.value, CaptureError) and info.value.status == 500
    assert server.routed("finish") == [{"annotations": {}, "paths": "mine"}]
    assert traj.result is None and traj.finishing == {}


async def test_finish_on_unreachable_server_is_capture_error(server: FakeServer) -> None:
    """Status None, chained to the transport error."""
    server.keep_alive = False
    async with CapturePool([server.url]) as pool:
        traj = await pool.create()
        server.stop()
        with pytest.raises(CaptureError) as info:
            await traj.finish({"reward": 0.5})
    assert info.value.status is None
    assert isinstance(info.value.__cause__, httpx.TransportError)
    assert str(info.value).startswith(f"POST {server.url}/trajectories/{traj.id}/finish: ")


async def test_finish_result_and_sample_decoding(server: FakeServer) -> None:
    async with CapturePool([server.url]) as pool:
        traj = await pool.create()
        result = await traj.finish({"reward": 1.0})
        again = await traj.finish({"reward": 1.0})
        document = await traj.document()
    assert isinstance(result, FinishResult) and traj.result is result and again is not result
    assert (result.status, result.unbridged_calls, result.context_length_exceeded) == (
        "finished",
        0,
        False,
    )
    assert document == {"id": traj.id, "status": "open"}
    tokens, text = result.samples
    assert tokens.input_ids == [1, 2, 3, 4, 5, 6, 7] and tokens.loss_mask == [0, 0, 0, 0, 1, 1, 1]
    assert tokens.logprobs == [0.0, 0.0, 0.0, 0.0, -0.5, -0.25, -1.0]
    assert all(type(x) is float for x in tokens.logprobs)
    experts = tokens.routed_experts
    assert (
        isinstance(experts, np.ndarray) and experts.dtype == np.uint8 and experts.shape == (7, 2, 2)
    )
    assert experts[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 5]
    assert tokens.sampling_mask == [[], [], [], [], [5, 8], [6], [7, 1, 2]]
    (image,) = tokens.media
    assert (image.modality, image.offset, image.length, image.hash) == ("image", 1, 2, "ab12")
    assert image.data is not None and image.data["pv"].dtype == np.float32
    np.testing.assert_array_equal(image.data["pv"], PIXELS)
    assert text == Sample(leaf=3, path=[2, 3], messages=[{"role": "user"}], targets=[3])
    assert text.input_ids is None and text.routed_experts is None and text.media == []
    assert result.record == RecordLocation(
        path="/data/rec/tr_1.json.zst", files=("tr_1.json.zst",), host="fd00::5"
    )
    assert result.record.local == "[fd00::5]:/data/rec/tr_1.json.zst" == result.record.uri


def test_record_location() -> None:
    assert RecordLocation.from_json(None) is None
    plain = RecordLocation.from_json({"path": "/r/a.json.zst", "host": "10.0.0.5"})
    assert plain is not None and plain.local == "10.0.0.5:/r/a.json.zst" and plain.files == ()
    assert RecordLocation(path="/r/a.json.zst").local == "/r/a.json.zst"
    mirrored = RecordLocation(path="/r/a.json.zst", mirror="s3://b/a.json.zst", host="h")
    assert mirrored.uri == "s3://b/a.json.zst"
    with pytest.raises(AttributeError):
        mirrored.path = "/elsewhere"  # type: ignore[misc]


def test_malformed_samples_are_refused() -> None:
    bad_csr = dict(TOKEN_SAMPLE, sampling_mask={"ids": [1], "offsets": [0, 1]})
    with pytest.raises(ValueError, match="invalid sampling_mask CSR: 2 offsets for 7"):
        Sample.from_json(bad_csr)
    falling = dict(TOKEN_SAMPLE, sampling_mask={"ids": [1], "offsets": [0, 1, 0, 0, 0, 0, 0, 1]})
    with pytest.raises(ValueError, match="must rise"):
        Sample.from_json(falling)
    with pytest.raises(PackedArrayError, match="invalid packed array"):
        Sample.from_json(dict(TOKEN_SAMPLE, routed_experts={"data": "AA", "shape": [9]}))
    with pytest.raises(ValueError, match="`leaf` must be int"):
        Sample.from_json(dict(TEXT_SAMPLE, leaf="3"))


async def test_malformed_finish_reply_is_capture_error(server: FakeServer) -> None:
    server.override("finish", (200, {"id": "tr_1", "status": "finished", "samples": [{"leaf": 1}]}))
    async with CapturePool([server.url]) as pool:
        traj = await pool.create()
        with pytest.raises(CaptureError, match="malformed finish reply: .*`path` must be list"):
            await traj.finish()


async def test_trajectory_normal_exit_finishes_with_empty_annotations(server: FakeServer) -> None:
    async with CapturePool([server.url]) as pool:
        async with pool.trajectory({"k": 1}, paths="final") as traj:
            assert traj.result is None and traj.paths == "final"
        assert traj.result is not None and traj.finishing == {}
        async with pool.trajectory() as done:
            await done.finish({"reward": 2})
    assert server.routed("finish") == [
        {"annotations": {}, "paths": "final"},
        {"annotations": {"reward": 2}, "paths": "all"},
    ]


async def test_trajectory_exception_finishes_with_error_and_reraises(server: FakeServer) -> None:
    async with CapturePool([server.url]) as pool:
        with pytest.raises(ValueError, match="harness broke"):
            async with pool.trajectory():
                raise ValueError("harness broke")
        server.override("finish", (500, {"error": "disk full"}))
        with pytest.raises(KeyError):
            async with pool.trajectory():
                raise KeyError("the finish failing too is swallowed")
    assert server.routed("finish") == [
        {"annotations": {"error": "ValueError"}, "paths": "all"},
        {"annotations": {"error": "KeyError"}, "paths": "all"},
    ]


async def test_trajectory_cancellation_finishes(server: FakeServer) -> None:
    entered = asyncio.Event()

    async def rollout(pool: CapturePool) -> None:
        async with pool.trajectory():
            entered.set()
            await asyncio.Event().wait()

    async with CapturePool([server.url]) as pool:
        task = asyncio.create_task(rollout(pool))
        await asyncio.wait_for(entered.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert server.routed("finish") == [{"annotations": {"error": "CancelledError"}, "paths": "all"}]


async def test_failed_finish_with_reward_is_resent_unchanged(server: FakeServer) -> None:
    server.override("finish", (503, {"error": "restarting"}))
    async with CapturePool([server.url]) as pool:
        with pytest.raises(CaptureError) as info:
            async with pool.trajectory() as traj:
                await traj.finish({"reward": 1.0, "note": "ok"}, paths="final")
    assert info.value.status == 503
    sent = {"annotations": {"reward": 1.0, "note": "ok"}, "paths": "final"}
    assert server.routed("finish") == [sent, sent]
    assert traj.result is not None and traj.result.status == "finished"


async def test_unserialisable_meta_is_refused_before_sending(server: FakeServer) -> None:
    async with CapturePool([server.url]) as pool:
        with pytest.raises(ValueError, match="meta must be JSON-serialisable"):
            await pool.create({"x": float("nan")})
    assert server.requests == []


def test_pool_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        CapturePool([])
    with pytest.raises(ValueError, match="non-empty list"):
        CapturePool("http://127.0.0.1:1")  # type: ignore[arg-type]


async def test_closed_pool_refuses_every_call(server: FakeServer) -> None:
    pool = CapturePool([server.url])
    traj = await pool.create()
    await pool.close()
    await pool.close()
    for call in (pool.create, traj.finish, traj.document, pool.__aenter__):
        with pytest.raises(RuntimeError, match="^the CapturePool is closed$"):
            await call()
    with pytest.raises(RuntimeError, match="^the CapturePool is closed$"):
        async with pool.trajectory():
            pass


def test_pool_survives_event_loop_changes(server: FakeServer) -> None:
    pool = CapturePool([server.url])

    async def rollout() -> str:
        async with pool.trajectory() as traj:
            await traj.finish({"reward": 1})
        return traj.id

    first, second = asyncio.run(rollout()), asyncio.run(rollout())
    assert first != second and len(server.routed("finish")) == 2
    asyncio.run(pool.close())
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(pool.create())


def test_close_from_another_loop_closes_the_client_on_its_own_loop(server: FakeServer) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        pool = CapturePool([server.url])
        asyncio.run_coroutine_threadsafe(pool.create(), loop).result(5)
        http = pool._client
        assert http is not None and not http.is_closed
        asyncio.run(pool.close())
        assert http.is_closed
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_import_does_not_pull_mitmproxy() -> None:
    code = "import sys, skycap.client; sys.exit('mitmproxy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0

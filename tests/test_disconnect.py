"""Text-mode calls outlive their harness's disconnect: SDK retries get the original reply."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from server_fixtures import Control, ServerThread, make_server, upstream, wait_for

from skycap.mock.anthropic import ScriptedAnthropicUpstream
from skycap.mock.upstream import Reply, ScriptedUpstream
from skycap.server.options import ServerOptions
from skycap.server.retry import RetryCache

GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SLOW = 1.2  # the upstream's delay; the SDK gives up after TIMEOUT and retries while it runs
TIMEOUT = 0.5


def state(server: ServerThread, trajectory: dict[str, Any]) -> dict[str, Any]:
    return server.run_in_loop(
        lambda: server.store.get(trajectory["id"]).trajectory.document(live=True)
    )


def calls_of(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [call for node in document["nodes"] for call in node["calls"]]


def model_nodes(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [node for node in document["nodes"] if node["author"] == "model"]


def check_one_call(server: ServerThread, trajectory: dict[str, Any], upstream: Any) -> None:
    """One upstream request, one model node, the call marked, the retry answered by replay."""
    assert len(upstream.requests) == 1
    document = state(server, trajectory)
    assert len(model_nodes(document)) == 1
    calls = calls_of(document)
    assert len(calls) == 1 and calls[0]["harness_saw_end"] is False
    assert document["failures"] == []
    assert document["retries"]["replayed"] >= 1
    assert document["retries"]["coalesced"] >= 1  # the first retry came while it ran


@pytest.fixture
def server(make_server) -> ServerThread:
    return make_server(upstream_timeout=5.0)


@pytest.fixture
def trajectory(server: ServerThread) -> dict[str, Any]:
    return Control(server.url).create()


def openai_sdk(trajectory: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=trajectory["base_url"], api_key="x", max_retries=3, timeout=TIMEOUT
    )


def test_sync_call_outlives_the_sdk_timeout(server, trajectory, upstream: ScriptedUpstream) -> None:
    upstream.fail_next("sleep", seconds=SLOW)
    reply = openai_sdk(trajectory).chat.completions.create(**GOOD)
    assert reply.choices[0].message.content == "echo: hi"
    check_one_call(server, trajectory, upstream)


def test_async_call_outlives_the_sdk_timeout(
    server, trajectory, upstream: ScriptedUpstream
) -> None:
    upstream.fail_next("sleep", seconds=SLOW)

    async def run() -> str | None:
        client = openai.AsyncOpenAI(
            base_url=trajectory["base_url"], api_key="x", max_retries=3, timeout=TIMEOUT
        )
        async with client:
            reply = await client.chat.completions.create(**GOOD)
        return reply.choices[0].message.content

    assert asyncio.run(run()) == "echo: hi"
    check_one_call(server, trajectory, upstream)


def test_sync_stream_retry_gets_the_recorded_stream(
    server, trajectory, upstream: ScriptedUpstream
) -> None:
    upstream.fail_next("sleep", seconds=SLOW)
    stream = openai_sdk(trajectory).chat.completions.create(**GOOD, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: hi"
    assert chunks[-1].usage is not None or chunks[-1].choices[0].finish_reason == "stop"
    check_one_call(server, trajectory, upstream)


def test_async_stream_retry_gets_the_recorded_stream(
    server, trajectory, upstream: ScriptedUpstream
) -> None:
    upstream.fail_next("sleep", seconds=SLOW)

    async def run() -> str:
        client = openai.AsyncOpenAI(
            base_url=trajectory["base_url"], api_key="x", max_retries=3, timeout=TIMEOUT
        )
        async with client:
            stream = await client.chat.completions.create(**GOOD, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert asyncio.run(run()) == "echo: hi"
    check_one_call(server, trajectory, upstream)


def test_a_stream_cut_off_mid_way_is_committed_marked_and_replayable(
    server, trajectory, upstream: ScriptedUpstream
) -> None:
    upstream.script = [Reply(content="one two three four five six seven eight")]
    upstream.chunk_delay = 0.1
    url = f"{trajectory['base_url']}/chat/completions"
    body = {**GOOD, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=10) as response:
        first = next(response.iter_raw())
    assert first.startswith(b"data: ")
    wait_for(
        lambda: calls_of(state(server, trajectory)), timeout=10, what="the cut-off stream's commit"
    )
    document = state(server, trajectory)
    (call,) = calls_of(document)
    assert call["harness_saw_end"] is False and call["finish_reason"] == "stop"
    (node,) = model_nodes(document)
    assert node["message"]["content"] == "one two three four five six seven eight"
    # A retry (which never came in time) now gets the recorded reply as the same SSE.
    upstream.chunk_delay = 0.0
    retry = httpx.post(url, json=body, headers={"x-stainless-retry-count": "1"}, timeout=10)
    assert retry.headers["content-type"].startswith("text/event-stream")
    assert retry.content.startswith(first) and retry.content.rstrip().endswith(b"data: [DONE]")
    assert len(upstream.requests) == 1
    assert state(server, trajectory)["retries"]["replayed"] == 1
    finished = Control(server.url).finish(trajectory["id"]).json()
    assert len(finished["samples"]) == 1


def test_a_stream_read_to_its_end_is_not_marked(
    server, trajectory, upstream: ScriptedUpstream
) -> None:
    stream = openai_sdk(trajectory).chat.completions.create(**GOOD, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "echo: hi"
    (call,) = calls_of(state(server, trajectory))
    assert "harness_saw_end" not in call


def test_upstream_timeout_still_cuts_off_a_call_nobody_waits_for(
    make_server, upstream: ScriptedUpstream
) -> None:
    server = make_server(upstream_timeout=0.3)
    trajectory = Control(server.url).create()
    upstream.fail_next("hang")
    client = openai.OpenAI(base_url=trajectory["base_url"], api_key="x", max_retries=0, timeout=0.1)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(**GOOD)
    failures = wait_for(
        lambda: state(server, trajectory)["failures"], timeout=10, what="the timeout failure"
    )
    assert "timed out after 0.3 s" in failures[0]["error"]
    assert calls_of(state(server, trajectory)) == []


@pytest.fixture
def anthropic_upstream() -> Iterator[ScriptedAnthropicUpstream]:
    with ScriptedAnthropicUpstream() as mock:
        yield mock


def test_anthropic_sdk_retry_gets_the_original_reply(
    anthropic_upstream: ScriptedAnthropicUpstream,
) -> None:
    options = ServerOptions(anthropic_upstream.base_url, upstream_timeout=5.0)
    with ServerThread(options) as server:
        trajectory = Control(server.url).create()
        anthropic_upstream.fail_next("sleep", seconds=SLOW)
        client = anthropic.Anthropic(
            base_url=trajectory["anthropic_base_url"], api_key="x", max_retries=3, timeout=TIMEOUT
        )
        message = client.messages.create(
            model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
        )
        assert message.content[0].text
        check_one_call(server, trajectory, anthropic_upstream)


def test_shutdown_records_a_call_still_running_as_failed(
    make_server, upstream: ScriptedUpstream, tmp_path
) -> None:
    from skycap.loader import load
    from skycap.server.store import SHUTDOWN_FAILURE

    server = make_server(record_dir=tmp_path)
    trajectory = Control(server.url).create()
    upstream.fail_next("hang")
    client = openai.OpenAI(base_url=trajectory["base_url"], api_key="x", max_retries=0, timeout=0.2)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(**GOOD)
    upstream.wait_for_requests(1)
    assert server.stop()
    record = load(tmp_path, trajectory["id"])
    assert [f["error"] for f in record.document["failures"]] == [SHUTDOWN_FAILURE]


def test_token_mode_retry_after_a_client_timeout_gets_the_original(
    qwen3_tokenizer: Any, qwen3_renderer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token mode already ran calls as their own task: still one engine call, replayed."""
    from skycap.mock.engine import ScriptedEngine

    retry_waiting = threading.Event()
    lookup = RetryCache.lookup

    async def noting_lookup(self: RetryCache, call: Any) -> Any:
        if self.running(call):
            retry_waiting.set()
        return await lookup(self, call)

    monkeypatch.setattr(RetryCache, "lookup", noting_lookup)

    def release_once_the_retry_waits() -> None:
        # The first attempt has given up; its call is still running. Releasing the engine
        # only once the retry waits on it makes the retry coalesce, never merely replay.
        if retry_waiting.wait(10):
            engine.release()

    def release_on_retry(request: httpx.Request) -> None:
        if request.headers.get("x-stainless-retry-count") == "1":
            threading.Thread(target=release_once_the_retry_waits, daemon=True).start()

    with ScriptedEngine(qwen3_tokenizer) as engine:
        options = ServerOptions(engine.url, mode="tokens", renderer=qwen3_renderer)
        with ServerThread(options) as server:
            trajectory = Control(server.url).create()
            engine.fail_next("hang")
            hooks = {"request": [release_on_retry]}
            client = openai.OpenAI(
                base_url=trajectory["base_url"],
                api_key="x",
                max_retries=3,
                timeout=TIMEOUT,
                http_client=httpx.Client(event_hooks=hooks, timeout=TIMEOUT),
            )
            reply = client.chat.completions.create(**GOOD)
            assert reply.choices[0].message.content
            generated = [r for r in engine.requests if r.path.endswith("/generate")]
            assert len(generated) == 1  # besides the served-model lookup at start
            document = state(server, trajectory)
            assert len(model_nodes(document)) == 1 and len(calls_of(document)) == 1
            assert document["retries"] == {"replayed": 1, "coalesced": 1}

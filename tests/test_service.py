"""CaptureService and CapturePool as a trainer uses them: the README snippet in both modes."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from skycap import CaptureError, CapturePool, CaptureService, load
from skycap.mock.engine import ScriptedEngine
from skycap.mock.upstream import ScriptedUpstream
from skycap.record.reader import document_path, read_document

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


async def run_harness(base_url: str, api_key: str, turns: int = 3) -> list[dict]:
    """A tool-using harness with the unchanged openai SDK, replaying replies as returned."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict] = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Look it up."},
    ]
    try:
        for _ in range(turns):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, temperature=0.6
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "found"})
    finally:
        await client.close()
    return messages


@pytest.fixture
def engine(qwen3_tokenizer):
    with ScriptedEngine(qwen3_tokenizer, sampling_mask=True) as scripted:
        yield scripted


def test_readme_snippet_in_token_mode(engine: ScriptedEngine, qwen3_dir: Path, tmp_path: Path):
    service = CaptureService(
        engine.url,
        mode="tokens",
        tokenizer=str(qwen3_dir),
        renderer_name="qwen3",
        renderer_pool_size=1,
        max_model_len=32768,
        record_dir=str(tmp_path),
        sampling_mask=True,  # the engine serves masks (--return-sampling-mask): top_k > 0
        sampling_overrides={"top_k": 20},
    )
    url = service.start()
    try:

        async def main():
            async with CapturePool([url]) as pool:
                async with pool.trajectory({"task": "t1", "step": 3}) as trajectory:
                    await run_harness(trajectory.base_url, trajectory.api_key)
                    return await trajectory.finish({"reward": 1.0})

        result = asyncio.run(main())
    finally:
        assert service.stop()
    assert result.status == "finished" and len(result.samples) == 1
    sample = result.samples[0]
    generate = [r for r in engine.requests if r.path.endswith("/generate")]
    last_prompt = generate[-1].body["token_ids"]
    # The leaf call's exact prompt, then its sampled completion.
    assert sample.input_ids[: len(last_prompt)] == last_prompt
    completion = sample.input_ids[len(last_prompt) :]
    assert completion and sample.loss_mask[len(last_prompt) :] == [1] * len(completion)
    assert isinstance(sample.input_ids, list) and isinstance(sample.logprobs, list)
    assert sample.routed_experts.shape[0] == len(sample.input_ids)
    assert len(sample.sampling_mask) == len(sample.input_ids)
    assert result.unbridged_calls == 0
    assert result.record is not None and Path(result.record.path).exists()
    # The record reads back to the same samples.
    again = load(tmp_path, result.id).samples("all")
    assert again[0].input_ids == sample.input_ids and again[0].loss_mask == sample.loss_mask


def test_readme_snippet_in_text_mode(tmp_path: Path):
    with ScriptedUpstream() as upstream:
        service = CaptureService(upstream.base_url, record_dir=str(tmp_path))
        url = service.start()
        try:

            async def main():
                async with CapturePool([url]) as pool:
                    async with pool.trajectory({"task": "t1"}) as trajectory:
                        messages = await run_harness(trajectory.base_url, trajectory.api_key, 1)
                        return messages, await trajectory.finish({"reward": 0.5})

            messages, result = asyncio.run(main())
        finally:
            assert service.stop()
    assert result.status == "finished"
    [sample] = result.samples
    assert sample.messages == messages and sample.input_ids is None
    assert read_document(document_path(tmp_path, result.id))["annotations"] == {"reward": 0.5}


def test_one_service_per_process_and_restart(tmp_path: Path):
    with ScriptedUpstream() as upstream:
        first = CaptureService(upstream.base_url)
        with pytest.raises(RuntimeError, match="not running: call run_in_loop between"):
            first.run_in_loop(lambda: None)
        first.start()
        second = CaptureService(upstream.base_url)
        with pytest.raises(RuntimeError, match="another CaptureService is running"):
            second.start()
        assert first.stop() and first.stop()  # idempotent
        with pytest.raises(RuntimeError, match="not running: call run_in_loop between"):
            first.run_in_loop(lambda: None)
        url = second.start()
        try:
            assert httpx.get(f"{url}/healthz").json()["ok"] is True
            # Server state is read on the server's own thread and loop.
            assert second.run_in_loop(threading.current_thread).name == "skycap"
            # The server's loop is uvloop's, as `skycap serve`'s is (docs/performance.md).
            loop = second.run_in_loop(asyncio.get_running_loop)
            assert type(loop).__module__.startswith("uvloop")
            assert second.run_in_loop(lambda: second.server.store.health()["ok"]) is True
        finally:
            second.stop()


def test_start_fails_clearly_when_the_port_is_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = CaptureService("http://127.0.0.1:9/v1", port=port)
        with pytest.raises(RuntimeError, match="skycap failed to start") as info:
            service.start(timeout=20)
        assert isinstance(info.value.__cause__, OSError)
    # The failed service released the process slot.
    with ScriptedUpstream() as upstream:
        service = CaptureService(upstream.base_url)
        service.start()
        service.stop()


def test_options_are_checked_before_anything_starts():
    with pytest.raises(TypeError):
        CaptureService("http://x/v1", no_such_option=1)
    with pytest.raises(ValueError, match="mode"):
        CaptureService("http://x/v1", mode="pictures")
    with pytest.raises(ValueError, match="renderer_name"):
        CaptureService("http://x", mode="tokens", renderer="Qwen/Qwen3-8B")


def test_stop_writes_open_trajectories_and_a_later_service_finishes_them(tmp_path: Path):
    with ScriptedUpstream() as upstream:
        service = CaptureService(upstream.base_url, record_dir=str(tmp_path))
        url = service.start()

        async def open_one() -> str:
            async with CapturePool([url]) as pool:
                trajectory = await pool.create({"task": "left open"})
                await run_harness(trajectory.base_url, trajectory.api_key, 1)
                return trajectory.id

        trajectory_id = asyncio.run(open_one())
        service.stop()
        document = read_document(document_path(tmp_path, trajectory_id))
        assert document["status"] == "open" and document["ended"] is False
        assert len(document["nodes"]) == 3

        later = CaptureService(upstream.base_url, record_dir=str(tmp_path))
        url = later.start()
        try:
            response = httpx.post(
                f"{url}/trajectories/{trajectory_id}/finish",
                json={"annotations": {"reward": 1}},
                headers={"Authorization": f"Bearer {later.control_token}"},
            )
        finally:
            later.stop()
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "finished" and len(body["samples"]) == 1
    document = read_document(document_path(tmp_path, trajectory_id))
    assert document["ended"] is True and document["annotations"] == {"reward": 1}


def _serve(upstream_url: str, record_dir: Path) -> tuple[subprocess.Popen, str]:
    """`skycap serve` in its own process on a free port; returns it and its URL."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "skycap.cli.main",
            "serve",
            "--upstream-url",
            upstream_url,
            "--port",
            "0",
            "--record-dir",
            str(record_dir),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return process, found.group(1)
        if not line and process.poll() is not None:
            break
    process.kill()
    raise AssertionError("skycap serve did not report its URL")


def test_a_pool_spreads_over_two_processes_and_survives_one_dying(tmp_path: Path):
    with ScriptedUpstream() as upstream:
        first, url_a = _serve(upstream.base_url, tmp_path / "a")
        second, url_b = _serve(upstream.base_url, tmp_path / "b")
        try:

            async def main():
                async with CapturePool([url_a, url_b]) as pool:
                    made = [await pool.create({"i": i}) for i in range(4)]
                    servers = [t.server for t in made]
                    assert servers[0] != servers[1] and servers[0::2] == [servers[0]] * 2
                    on_a = next(t for t in made if t.server == url_a)
                    first.terminate()
                    first.wait(timeout=30)
                    survivors = [await pool.create({"after": i}) for i in range(3)]
                    assert {t.server for t in survivors} == {url_b}
                    with pytest.raises(CaptureError) as info:
                        await on_a.finish({"reward": 1})
                    assert info.value.status is None

            asyncio.run(main())
        finally:
            for process in (first, second):
                process.terminate()
                process.wait(timeout=30)


def test_a_record_missing_a_listed_sidecar_is_never_rewritten(
    engine: ScriptedEngine, qwen3_dir: Path, tmp_path: Path
):
    options = dict(
        mode="tokens",
        tokenizer=str(qwen3_dir),
        renderer_name="qwen3",
        renderer_pool_size=1,
        record_dir=str(tmp_path),
        sampling_overrides={"top_k": 20},  # the engine serves sampling masks
    )
    service = CaptureService(engine.url, **options)
    url = service.start()
    try:

        async def open_one() -> str:
            async with CapturePool([url]) as pool:
                trajectory = await pool.create()
                await run_harness(trajectory.base_url, trajectory.api_key, 1)
                return trajectory.id

        trajectory_id = asyncio.run(open_one())
    finally:
        service.stop()
    (tmp_path / f"{trajectory_id}.tokens.zst").unlink()
    before = document_path(tmp_path, trajectory_id).read_bytes()
    later = CaptureService(engine.url, **options)
    url = later.start()
    try:
        response = httpx.post(
            f"{url}/trajectories/{trajectory_id}/finish",
            json={},
            headers={"Authorization": f"Bearer {later.control_token}"},
        )
    finally:
        later.stop()
    assert response.status_code == 500
    assert "lists tokens but the file is not in" in response.json()["error"]
    assert document_path(tmp_path, trajectory_id).read_bytes() == before


def test_a_failed_build_frees_the_process_slot(tmp_path: Path):
    broken = CaptureService(
        "http://127.0.0.1:9",
        mode="tokens",
        tokenizer=str(tmp_path / "no-such-tokenizer"),
        renderer_name="qwen3",
        renderer_pool_size=1,
    )
    with pytest.raises(Exception, match="no-such-tokenizer"):
        broken.start()
    with ScriptedUpstream() as upstream:
        service = CaptureService(upstream.base_url)
        service.start()
        assert service.proxy_url is None
        service.stop()


def test_proxy_mode_is_reachable_from_the_pool(tmp_path: Path):
    with ScriptedUpstream() as upstream:
        service = CaptureService(upstream.base_url, proxy_port=0, confdir=str(tmp_path / "ca"))
        url = service.start()
        try:

            async def main():
                async with CapturePool([url]) as pool:
                    return await pool.create()

            trajectory = asyncio.run(main())
        finally:
            service.stop()
    assert service.proxy_url is not None and service.proxy_url.startswith("http://127.0.0.1:")
    port = service.proxy_url.rsplit(":", 1)[1]
    assert trajectory.proxy_url == f"http://{trajectory.id}:{trajectory.api_key}@127.0.0.1:{port}"
    assert trajectory.env["HTTPS_PROXY"] == trajectory.proxy_url
    assert Path(trajectory.env["SSL_CERT_FILE"]).is_file()

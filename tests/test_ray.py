"""skycap.ray on a real local Ray cluster of two loopback nodes: placement, rollouts, a dead
actor's losses reported by id, and a stop that leaves nothing running."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from server_fixtures import record_files, wait_for

from skycap.mock.upstream import ScriptedUpstream

if os.environ.get("CI") == "true":
    import ray  # under CI the extra must be there: an ImportError fails the run
else:
    ray = pytest.importorskip("ray")


async def rollout(pool: Any, task: int) -> tuple[str, str]:
    """One two-turn trajectory through the unchanged openai SDK; its (server, id)."""
    async with pool.trajectory({"task": task}) as trajectory:
        client = AsyncOpenAI(base_url=trajectory.base_url, api_key=trajectory.api_key)
        messages: list[Any] = [{"role": "user", "content": f"task {task}"}]
        for _ in range(2):
            reply = await client.chat.completions.create(model="m", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True)]
            messages.append({"role": "user", "content": "go on"})
        await client.close()
        result = await trajectory.finish({"reward": 1.0})
        assert result.status == "finished" and len(result.samples) == 1
        return trajectory.server, trajectory.id


def test_spread_text_rollouts_then_a_dead_actor_is_reported_and_replaced(
    ray_cluster: Any, tmp_path: Path
) -> None:
    from skycap.ray import CaptureServers

    with ScriptedUpstream() as upstream:
        servers = CaptureServers.start(
            2,
            placement="SPREAD",
            cpus_per_server=0.5,
            upstream_url=upstream.base_url,
            record_dir=tmp_path,
            record_mirror=(tmp_path / "mirror").as_uri(),
        )
        try:
            assert len({s.node_id for s in servers.servers}) == 2, "SPREAD: one per node"
            assert all(s.url.startswith(f"http://{s.node_ip}:") for s in servers.servers)
            pool = servers.pool()

            async def batch() -> list[tuple[str, str]]:
                return await asyncio.gather(*(rollout(pool, i) for i in range(4)))

            done = asyncio.run(batch())
            assert {server for server, _ in done} == set(servers.urls)
            assert record_files(tmp_path) == sorted(f"{i}.json.zst" for _, i in done)
            assert pool.open_trajectories() == {url: [] for url in servers.urls}

            async def open_two() -> list[Any]:
                return [await pool.create({"task": "held"}) for _ in range(2)]

            held = asyncio.run(open_two())
            victim = servers.servers[0]
            os.kill(victim.pid, signal.SIGKILL)
            lost = wait_for(lambda: servers.lost, timeout=60, what="the dead actor reported")
            [report] = lost
            assert report.url == victim.url
            assert report.trajectory_ids == tuple(t.id for t in held if t.server == victim.url)
            assert report.replaced_by is not None and report.replaced_by in servers.urls
            assert victim.url not in pool.urls and report.replaced_by in pool.urls
            survivor = next(t for t in held if t.server != victim.url)

            async def after() -> tuple[str, str]:
                await survivor.finish()
                return await rollout(pool, 9)

            asyncio.run(after())
            urls = servers.urls
        finally:
            assert servers.stop()
        assert f"{survivor.id}.json.zst" in record_files(tmp_path)
        # stop() drained the mirror: every record is copied there too.
        assert record_files(tmp_path / "mirror") == record_files(tmp_path)
        for url in urls:  # nothing listens any more
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/healthz", timeout=5)
        assert ray.util.placement_group_table() == {} or all(
            g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()
        )


def test_pack_token_mode_rollouts(
    ray_cluster: Any, tmp_path: Path, qwen3_dir: Path, scripted_engine: Any
) -> None:
    from skycap.ray import CaptureServers

    servers = CaptureServers.start(
        2,
        placement="PACK",
        cpus_per_server=0.5,
        upstream_url=scripted_engine.url,
        mode="tokens",
        tokenizer=str(qwen3_dir),
        renderer_name="qwen3",
        record_dir=tmp_path,
    )
    try:
        assert len({s.node_id for s in servers.servers}) == 1, "PACK: both on one node"
        pool = servers.pool()

        async def batch() -> list[tuple[str, str]]:
            return await asyncio.gather(*(rollout(pool, i) for i in range(2)))

        done = asyncio.run(batch())
        assert {server for server, _ in done} == set(servers.urls)
    finally:
        assert servers.stop()
    assert record_files(tmp_path) == sorted(f"{i}.json.zst" for _, i in done)
    assert all((tmp_path / f"{i}.tokens.zst").exists() for _, i in done)

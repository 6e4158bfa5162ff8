"""SkycapRuntime from one config: Ray capture servers for a driver started with `uv run
--project . --no-sync` (Ray's uv hook once ran its actors in an environment without ray), and a
local server without Ray; stop writes every record and leaves no process or thread behind."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from server_fixtures import record_files, wait_for

from skycap.integrations.skyrl import SkycapConfig, SkycapRuntime
from skycap.mock.upstream import ScriptedUpstream

ROOT = Path(__file__).resolve().parent.parent

DRIVER = '''"""A trainer's driver: the runtime from a cfg.skycap block on the cluster it joined."""
import asyncio, json, sys

import ray
from openai import AsyncOpenAI

from skycap.integrations.skyrl import SkycapConfig, SkycapRuntime

address, upstream, records = sys.argv[1:4]
ray.init(address=address, log_to_driver=False)
block = {"servers": 2, "cpus_per_server": 0.5, "mode": "text", "upstream_url": upstream,
         "record_dir": records}
runtime = SkycapRuntime.start(SkycapConfig.from_mapping(block))


async def call(finish):
    trajectory = await runtime.pool().create({"task": "driver"})
    client = AsyncOpenAI(base_url=trajectory.base_url, api_key=trajectory.api_key)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await client.close()
    if finish:
        await trajectory.finish({"reward": 1.0})
    return trajectory.id


async def main():
    return await asyncio.gather(*(call(finish) for finish in (True, False)))


ids = asyncio.run(main())
pids = [server.pid for server in runtime.servers.servers]
print(json.dumps({"on_ray": runtime.on_ray, "ids": ids, "pids": pids, "stopped": runtime.stop()}))
'''


def alive(pid: int) -> bool:
    """A running process (a zombie waiting for its parent to reap it is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


async def held_call(runtime: SkycapRuntime) -> str:
    """One call on a trajectory left open: only stop() writes its record."""
    trajectory = await runtime.pool().create({"task": "held"})
    async with AsyncOpenAI(base_url=trajectory.base_url, api_key=trajectory.api_key) as client:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
    return trajectory.id


def test_a_uv_run_no_sync_driver_starts_ray_servers_and_stops_them(
    ray_cluster: Any, tmp_path: Path
) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    records = tmp_path / "records"
    with ScriptedUpstream() as upstream:
        run = subprocess.run(
            [uv, "run", "--project", ".", "--no-sync", "python", str(driver)]
            + [ray_cluster.address, upstream.base_url, str(records)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["on_ray"] and report["stopped"]
    # Both records are written: the finished one, and the open one stop() wrote.
    assert record_files(records) == sorted(f"{i}.json.zst" for i in report["ids"])
    wait_for(
        lambda: not any(alive(pid) for pid in report["pids"]),
        timeout=60,
        what="the capture actors' processes gone",
    )


def test_without_ray_one_local_server_stops_with_every_record_written(tmp_path: Path) -> None:
    block = {"servers": 1, "ray": False, "mode": "text", "record_dir": str(tmp_path)}
    with ScriptedUpstream() as upstream:
        runtime = SkycapRuntime.start(
            SkycapConfig.from_mapping({**block, "upstream_url": upstream.base_url})
        )
        try:
            assert not runtime.on_ray and len(runtime.urls) == 1
            held = asyncio.run(held_call(runtime))
        finally:
            assert runtime.stop()
    assert record_files(tmp_path) == [f"{held}.json.zst"]
    assert not [t for t in threading.enumerate() if t.name == "skycap"]
    assert runtime.stop()  # idempotent


def test_several_servers_without_ray_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"skycap\.servers"):
        SkycapRuntime.start({"servers": 2, "ray": False})

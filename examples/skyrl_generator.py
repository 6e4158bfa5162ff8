"""A SkyRL generator on skycap: the calculator agent as a SkycapGenerator, its servers from a
`cfg.skycap` block, one SkyRL batch in and a step-wise `GeneratorOutput` out, checked by SkyRL's
rules (and by skyrl's own validator when skyrl is installed).

    uv run python examples/skyrl_generator.py

Runs against a scripted engine that also returns routed experts (R3), so it needs no GPU and
no skyrl; the records land in a new run folder under ./records. In a SkyRL run the trainer
builds the batch and calls `generate`, and `SkycapCallback(generator)` indexes each step
(docs/skyrl.md).
"""

from __future__ import annotations

import asyncio
import importlib
import json
from typing import Any

from helpers.calculator_task import (
    PROMPTS,
    SYSTEM,
    TOOLS,
    Calculator,
    qwen3_folder,
    reward,
    scripted_policy,
)
from openai import AsyncOpenAI

from skycap import new_run_dir
from skycap.integrations.skyrl import (
    Rollout,
    SkycapConfig,
    SkycapGenerator,
    SkycapRuntime,
    TrajectoryID,
    openai_sampling,
)

REPETITIONS = 2
#: SkyRL's sampling params for the vLLM backend (its `get_vllm_sampling_params`).
SKYRL_SAMPLING = {
    "min_tokens": 1,
    "skip_special_tokens": True,
    "include_stop_str_in_output": True,
    "max_tokens": 512,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "logprobs": 0,
    "stop": None,
}


class CalculatorAgent(SkycapGenerator):
    """The harness: all a SkyRL user writes. `prompt["messages"]` is SkyRL's conversation and
    the rest of `prompt` its env_extras."""

    calculator = Calculator()

    async def run_rollout(
        self, prompt: Any, *, base_url: str, api_key: str, sampling: dict[str, Any], env: Any
    ) -> Rollout:
        messages = [{"role": "system", "content": SYSTEM}, *prompt["messages"]]
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for _ in range(4):
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, tools=TOOLS, **openai_sampling(sampling)
                )
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    return Rollout(reward(message.content or "", prompt["answer"]))
                for call in message.tool_calls:
                    result = self.calculator(json.loads(call.function.arguments)["expression"])
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return Rollout(0.0)


def generator_input(step: int) -> dict[str, Any]:
    """What SkyRL's trainer passes: prompts already repeated, one trajectory id each."""
    chosen = PROMPTS[:2]
    return {
        "prompts": [[{"role": "user", "content": p["question"]}] for p in chosen for _ in range(2)],
        "env_classes": ["calculator"] * 2 * REPETITIONS,
        "env_extras": [{"answer": p["answer"]} for p in chosen for _ in range(REPETITIONS)],
        "sampling_params": SKYRL_SAMPLING,
        "trajectory_ids": [
            TrajectoryID(p["instance_id"], r) for p in chosen for r in range(REPETITIONS)
        ],
        "batch_metadata": {"global_step": step, "training_phase": "train"},
    }


def check(output: dict[str, Any], num_prompts: int) -> None:
    """SkyRL's rules for step-wise output (`validate_generator_output`), then skyrl's own."""
    rows = len(output["response_ids"])
    assert rows >= num_prompts and len(output["prompt_token_ids"]) == rows
    for i in range(rows):
        n = len(output["response_ids"][i])
        assert n == len(output["loss_masks"][i]) == len(output["rewards"][i])
        assert n == len(output["rollout_logprobs"][i])
        experts = output["rollout_expert_indices"][i]
        assert len(experts) == len(output["prompt_token_ids"][i]) + n  # prompt + response
    ids = [t.to_string() for t in output["trajectory_ids"]]
    last = output["is_last_step"]
    assert last[-1] is True
    for i in range(rows - 1):
        assert last[i] is (ids[i] != ids[i + 1])  # rows of a trajectory are contiguous
    assert len(set(ids)) == sum(last) == num_prompts
    try:
        skyrl = importlib.import_module("skyrl.train.utils.trainer_utils")
    except ImportError:
        return
    skyrl.validate_generator_output(num_prompts, output, step_wise=True)


async def train(runtime: SkycapRuntime) -> None:
    generator = runtime.generator(CalculatorAgent, concurrency=4, timeout=60, attempts=2)
    batch = generator_input(step=1)
    output = await generator.generate(batch)
    check(output, len(batch["prompts"]))
    ids = [t.to_string() for t in output["trajectory_ids"]]
    print(f"step 1: {len(ids)} step-wise rows from {len(batch['prompts'])} rollouts, valid")
    for tid in dict.fromkeys(ids):
        rows = [i for i, t in enumerate(ids) if t == tid]
        final = output["rewards"][rows[-1]][-1]
        lengths = " ".join(f"{len(output['response_ids'][i])}" for i in rows)
        print(f"  {tid:<14} {len(rows)} calls, response tokens {lengths}, reward {final:.0f}")
    metrics = output["rollout_metrics"]
    for name in ("retried_rollouts", "num_unbridged_calls", "placeholder_rows", "trained_tokens"):
        print(f"  generate/{name}={metrics[f'generate/{name}']}")
    experts = output["rollout_expert_indices"][0]
    print(f"  routed experts: {len(experts)} positions x {len(experts[0])} layers (R3)")
    generator.on_step_end(1, output["trajectory_ids"])  # what SkycapCallback calls


def main() -> None:
    from transformers import AutoTokenizer

    from skycap.mock.engine import ScriptedEngine

    folder = qwen3_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with ScriptedEngine(tokenizer, script=scripted_policy(tokenizer), experts=(4, 2)) as engine:
        block = {  # cfg.skycap in SkyRL's config; here without Ray
            "servers": 1,
            "ray": False,
            "upstream_url": engine.url,
            "tokenizer": folder,
            "renderer_name": "qwen3",
            "renderer_pool_size": 1,
            "record_dir": str(new_run_dir("records", "skyrl_generator").resolve()),
            "policy": {"max_seq_len": 4096},
        }
        with SkycapRuntime.start(SkycapConfig.from_mapping(block)) as runtime:
            asyncio.run(train(runtime))


if __name__ == "__main__":
    main()

"""The SkyRL generator over the unchanged openai SDK in token mode on the scripted engine (real
Qwen3 tokenizer): its output keeps SkyRL's rules, a crashed attempt is superseded, an
all-masked batch stays valid, routed experts match the engine, and the step hook indexes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rollout_agents import client_for, episode
from skyrl_rules import check_output, full_rows, key, token_block

from skycap.index import RecordIndex
from skycap.integrations.skyrl import (
    Rollout,
    SkycapConfig,
    SkycapGenerator,
    SkycapRuntime,
    TrajectoryID,
)
from skycap.mock.engine import ScriptedEngine
from skycap.mock.engine_wire import scripted_experts

LAYERS, TOP_K = 4, 2
CALLS = 3  # the scripted engine's episode: the tool twice, then the answer


@dataclass
class BatchMetadata:
    """SkyRL's `BatchMetadata`: the step and phase of a generate call."""

    global_step: int
    training_phase: str


class Agent(SkycapGenerator):
    """A tool-using agent on the openai SDK; the entry `crash_once` names raises after one
    call, once."""

    crashed: set[str]

    async def run_rollout(
        self, prompt: Any, *, base_url: str, api_key: str, sampling: dict[str, Any], env: Any
    ) -> Rollout:
        async with client_for(base_url, api_key) as client:
            messages = [dict(m) for m in prompt["messages"]]
            if prompt.get("crash_once") == prompt["name"] and prompt["name"] not in self.crashed:
                self.crashed.add(prompt["name"])
                await client.chat.completions.create(model="policy", messages=messages)
                raise ConnectionError("the tool service reset the connection")
            if prompt.get("time_out"):
                await client.chat.completions.create(model="policy", messages=messages)
                return Rollout(0.0, "agent_timeout")
            if prompt.get("hang"):
                await client.chat.completions.create(model="policy", messages=messages)
                await asyncio.Event().wait()  # until the trainer gives up on the batch
            if prompt.get("fail"):
                raise RuntimeError("the sandbox did not start")
            answer, calls = await episode(client, messages, sampling)
        return Rollout(1.0 if answer else 0.0, annotations={"calls": calls})


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer: Any) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer, experts=(LAYERS, TOP_K)) as scripted:
        yield scripted


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("skyrl-records")


@pytest.fixture(scope="module")
def runtime(engine: ScriptedEngine, qwen3_dir: Path, records: Path) -> Iterator[SkycapRuntime]:
    """A token-mode server started from a `cfg.skycap` block, without Ray."""
    block = token_block(engine.url, qwen3_dir, records)
    started = SkycapRuntime.start(SkycapConfig.from_mapping(block))
    yield started
    assert started.stop()


def make_agent(runtime: SkycapRuntime, **options: Any) -> Agent:
    agent = runtime.generator(
        Agent, **{"concurrency": 4, "attempts": 2, "progress": False, **options}
    )
    agent.crashed = set()
    return agent


def batch(
    extras: list[dict[str, Any]], reps: int = 2, step: int = 3, phase: str = "train"
) -> dict[str, Any]:
    """SkyRL's `GeneratorInput`: each prompt repeated `reps` times (as SkyRL expands them)."""
    prompts, ids, env_extras = [], [], []
    for extra in extras:
        for rep in range(reps):
            prompts.append([{"role": "user", "content": f"Investigate {extra['name']}."}])
            ids.append(TrajectoryID(extra["name"], rep))
            env_extras.append({**extra, "name": f"{extra['name']}-{rep}"})
    return {
        "prompts": prompts,
        "env_classes": ["skycap"] * len(prompts),
        "env_extras": env_extras,
        "sampling_params": {"temperature": 1.0},
        "trajectory_ids": ids,
        "batch_metadata": BatchMetadata(step, phase),
    }


def test_step_rows_keep_skyrl_rules_and_supersede_the_crashed_attempt(
    runtime: SkycapRuntime, records: Path
) -> None:
    index = RecordIndex("skyrl-test", record_dir=records)
    agent = make_agent(runtime, index=index)
    extras = [{"name": "alpha"}, {"name": "beta", "crash_once": "beta-1"}]
    output = asyncio.run(agent.generate(batch(extras)))
    check_output(output, 4)
    # One row per model call of each counting attempt: the crashed attempt's call is not here.
    ids = [key(t) for t in output["trajectory_ids"]]
    assert ids == [t for t in ("alpha_0", "alpha_1", "beta_0", "beta_1") for _ in range(CALLS)]
    assert output["is_last_step"] == [False, False, True] * 4
    assert all(len(m) and any(m) for m in output["loss_masks"])
    assert [r[-1] for r in output["rewards"]] == [0.0, 0.0, 1.0] * 4
    assert output["stop_reasons"] == ["complete"] * 12
    assert output["env_metrics"][0] == {"reward": 1.0, "stop_reason": "complete", "calls": CALLS}
    times = output["trajectory_generation_times"]
    assert all(t > 0 for t in times) and len(set(times[i] for i in range(0, 12, 3))) > 1
    # Each step row's prompt is the one before's prompt and response plus the tool result.
    for i in range(0, 12, CALLS):
        for j in range(i, i + CALLS - 1):
            before = full_rows(output, j)
            assert np.array_equal(
                np.array(output["prompt_token_ids"][j + 1][: len(before)]), before
            )
    metrics = output["rollout_metrics"]
    assert metrics["generate/retried_rollouts"] == 1
    assert metrics["generate/num_unbridged_calls"] == 0
    assert metrics["generate/placeholder_rows"] == 0

    attempts = agent.record_log.entries("train", 3)
    superseded = [a for a in attempts if a.superseded]
    assert len(attempts) == 5 and len(superseded) == 1 and superseded[0].instance_id == "beta"
    document = agent.on_step_end(3, output["trajectory_ids"])
    assert document is not None and len(agent.record_log) == 0
    trained = {row["id"] for row in document["rows"] if row["trained"]}
    assert superseded[0].id not in trained and len(trained) == 4
    written = json.loads((records / "index/train/step-3.json").read_text())
    assert sorted(r["id"] for r in written["rows"]) == sorted(a.id for a in attempts)
    index.close()


def test_routed_experts_cover_prompt_and_response_as_the_engine_returned_them(
    runtime: SkycapRuntime,
) -> None:
    """R3 with step-wise rows: each row's experts are the engine's, position by position."""
    agent = make_agent(runtime, require_experts=True)
    output = asyncio.run(agent.generate(batch([{"name": "gamma"}], reps=1)))
    check_output(output, 1)
    experts = output["rollout_expert_indices"]
    assert len(experts) == CALLS
    for i, routed in enumerate(experts):
        ids = full_rows(output, i).tolist()
        array = np.array(routed)
        assert array.shape == (len(ids), LAYERS, TOP_K)
        assert np.array_equal(array[:-1], scripted_experts(ids, 0, LAYERS, TOP_K))


def test_an_all_masked_batch_is_still_valid_and_says_why(runtime: SkycapRuntime) -> None:
    """An entry that captured nothing gets one placeholder row; one that timed out keeps its
    rows, masked. Both say why in env_metrics, and the groups keep their shape."""
    agent = make_agent(runtime, attempts=1)
    extras = [{"name": "broken", "fail": True}, {"name": "slow", "time_out": True}]
    output = asyncio.run(agent.generate(batch(extras, reps=1, step=4)))
    check_output(output, 2)
    assert [key(t) for t in output["trajectory_ids"]] == ["broken_0", "slow_0"]
    assert not any(any(mask) for mask in output["loss_masks"])
    assert output["prompt_token_ids"][0] == [0] and output["response_ids"][0] == [0]
    assert output["env_metrics"][0] == {"skycap_masked": "error"}
    assert output["env_metrics"][1]["skycap_masked"] == "agent_timeout"
    assert output["stop_reasons"] == ["error", "agent_timeout"]
    # The placeholder's experts are zeros, so the batch's expert rows still line up.
    assert np.array(output["rollout_expert_indices"][0]).shape == (2, LAYERS, TOP_K)
    metrics = output["rollout_metrics"]
    assert metrics["generate/placeholder_rows"] == 1
    assert metrics["generate/placeholder_rows/error"] == 1
    assert metrics["generate/masked/error"] == 1 and metrics["generate/masked/agent_timeout"] == 1
    assert agent.on_step_end(4) is None  # no index: the step only leaves the log
    assert len(agent.record_log) == 0


def test_final_rows_are_one_per_entry_for_non_step_wise_training(runtime: SkycapRuntime) -> None:
    agent = make_agent(runtime, mode="final")
    output = asyncio.run(agent.generate(batch([{"name": "delta"}], reps=2, step=5)))
    check_output(output, 2, step_wise=False)
    assert output["is_last_step"] == [True, True]
    for i in range(2):  # every call's completion trains, the tool results between do not
        mask = output["loss_masks"][i]
        assert mask[0] == 1 and mask[-1] == 1 and 0 in mask


def test_a_dropped_batch_is_discarded_at_the_next_step_and_eval_has_its_phase(
    runtime: SkycapRuntime, records: Path
) -> None:
    index = RecordIndex("skyrl-phases", phases=("train", "eval"), record_dir=records / "phases")
    agent = make_agent(runtime, index=index)

    async def dropped() -> None:
        with pytest.raises(TimeoutError):  # the harness hangs; the trainer gives up on the batch
            await asyncio.wait_for(
                agent.generate(batch([{"name": "eps", "hang": True}], step=6)), 2.0
            )

    asyncio.run(dropped())
    stale = agent.record_log.entries("train", 6)
    assert stale and all(a.dropped for a in stale)
    output = asyncio.run(agent.generate(batch([{"name": "zeta"}], reps=1, step=7)))
    assert agent.record_log.entries("train", 6) == []  # gone at the next step's start
    document = agent.on_step_end(7, output["trajectory_ids"])
    assert document is not None
    assert [r["instance_id"] for r in document["rows"]] == ["zeta"]
    evaluated = asyncio.run(agent.generate(batch([{"name": "eta"}], reps=1, step=7, phase="eval")))
    check_output(evaluated, 1)
    eval_doc = agent.on_step_end(7, None, "eval")
    assert eval_doc is not None and eval_doc["phase"] == "eval"
    assert [r["trained"] for r in eval_doc["rows"]] == [False]  # eval never trains
    assert (records / "phases/index/eval/step-7.json").exists()
    index.close()

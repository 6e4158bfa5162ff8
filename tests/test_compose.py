"""Compose on graphs built by real captures (linear, resampled, branched, compacted, failed,
length-stopped, with routed experts and sampling masks): rows equal the samples, step rows
rebuild the path, experts and masks align, and every policy produces its documented masks."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from rollout_agents import SYSTEM, TOOLS, client_for, episode, openai_sampling, replayed
from server_fixtures import ServerThread

from skycap import CapturePool
from skycap.client import FinishResult, Sample
from skycap.compose import Policy, TrainingRow, compose
from skycap.mock.engine import ScriptedEngine
from skycap.mock.engine_wire import scripted_experts, scripted_logprob
from skycap.rollout import Rollout, RolloutResult, RolloutRunner
from skycap.server.options import ServerOptions

LAYERS, TOP_K = 4, 2
SAMPLING = {"temperature": 1.0, "top_k": 20}
SHAPES = ("linear", "resampled", "branched", "compacted", "failed", "length")


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer: Any) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer, experts=(LAYERS, TOP_K), sampling_mask=True) as scripted:
        yield scripted


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compose-records")


class Shapes(RolloutRunner):
    """One agent whose prompt names the graph shape its episode should leave."""

    def __init__(self, pool: CapturePool, engine: ScriptedEngine) -> None:
        super().__init__(pool, concurrency=1, attempts=1)
        self.engine = engine

    async def run_rollout(
        self, prompt: Any, *, base_url: str, api_key: str, sampling: dict[str, Any], env: Any
    ) -> Rollout:
        client = client_for(base_url, api_key)
        prompt = prompt["instance_id"]
        try:
            if prompt == "length":
                return await self._length(client, sampling)
            answer, _ = await episode(
                client,
                f"Investigate {prompt}.",
                sampling,
                hook=self._hook(prompt, client, sampling),
            )
        except openai.APIStatusError as exc:
            assert prompt == "failed" and exc.status_code == 410
            return Rollout(0.0)
        finally:
            await client.close()
        return Rollout(1.0 if answer.startswith("Done") else 0.0)

    def _hook(self, shape: str, client: Any, sampling: dict[str, Any]) -> Any:
        async def hook(call: int, messages: list[dict[str, Any]]) -> None:
            if shape == "resampled" and call == 0:  # sample the first turn twice
                await self._extra(client, messages, sampling)
            elif shape == "branched" and call == 1:  # a second tool result for the same call
                other = [*messages[:-1], {**messages[-1], "content": "no notes"}]
                await self._extra(client, other, sampling)
            elif shape == "compacted" and call == 2:
                messages[:] = [SYSTEM, {"role": "user", "content": "Summary: 2 searches done."}]
            elif shape == "failed" and call == 1:
                self.engine.fail_next("experts_coverage")

        return hook

    async def _extra(
        self, client: Any, messages: list[dict[str, Any]], sampling: dict[str, Any]
    ) -> None:
        self.engine.queue("<think>\nA guess.\n</think>\n\nDone: guessed.")
        await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, **openai_sampling(sampling)
        )

    async def _length(self, client: Any, sampling: dict[str, Any]) -> Rollout:
        """The first reply is cut at max_tokens; the harness asks it to go on."""
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Think long."}]
        cut = await client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=TOOLS,
            max_tokens=6,
            **openai_sampling(sampling),
        )
        assert cut.choices[0].finish_reason == "length"
        messages += [replayed(cut.choices[0].message), {"role": "user", "content": "Go on."}]
        answer, _ = await episode(client, messages, sampling)
        return Rollout(1.0 if answer.startswith("Done") else 0.0)


@pytest.fixture(scope="module")
def captured(
    engine: ScriptedEngine, qwen3_renderer: Any, records: Path
) -> Iterator[dict[str, RolloutResult]]:
    """One real capture per shape; the server stays up for tests that read its records."""
    options = ServerOptions(
        engine.url, mode="tokens", renderer=qwen3_renderer, sampling_mask=True, record_dir=records
    )
    server = ServerThread(options)
    server.start()
    try:

        async def run() -> list[RolloutResult]:
            async with CapturePool([server.url]) as pool:
                prompts = [{"instance_id": shape} for shape in SHAPES]
                return await Shapes(pool, engine).generate(prompts, sampling=SAMPLING)

        results = asyncio.run(run())
        yield dict(zip(SHAPES, results, strict=True))
    finally:
        server.stop()


def one(result: RolloutResult, mode: str = "path", **policy: Any) -> list[TrainingRow]:
    return compose([result], mode, policy=Policy(**policy)).rows


def requests_of(engine: ScriptedEngine, trajectory_id: str) -> list[list[int]]:
    return [
        r.body["token_ids"]
        for r in engine.requests
        if r.method == "POST" and r.headers.get("X-Session-ID") == trajectory_id
    ]


def check_equal_to_sample(row: TrainingRow, sample: Sample) -> None:
    assert row.input_ids.dtype == np.int32 and row.loss_mask.dtype == np.int8
    assert row.input_ids.tolist() == sample.input_ids
    assert row.loss_mask.tolist() == sample.loss_mask
    assert np.array_equal(row.logprobs, np.asarray(sample.logprobs, dtype=np.float32))
    assert np.array_equal(row.routed_experts, sample.routed_experts)
    assert row.sampling_mask_rows() == sample.sampling_mask
    assert (row.leaf, list(row.targets)) == (sample.leaf, sample.targets)


def check_aligned(row: TrainingRow) -> None:
    """Experts and masks line up with the row's own tokens, position by position."""
    ids = row.input_ids.tolist()
    n = len(ids)
    assert row.routed_experts.shape == (n, LAYERS, TOP_K)
    assert np.array_equal(row.routed_experts[: n - 1], scripted_experts(ids, 0, LAYERS, TOP_K))
    masks = row.sampling_mask_rows()
    assert len(masks) == n
    for p in range(n):
        trained = bool(row.loss_mask[p])
        assert masks[p] == ([ids[p], ids[p] + 1] if trained else [])
        if trained:
            assert row.logprobs[p] == np.float32(scripted_logprob(ids[p], p))


def test_the_captures_have_the_shapes_they_claim(captured: dict[str, RolloutResult]) -> None:
    paths = {shape: len(r.result.samples) for shape, r in captured.items()}
    assert paths == {
        "linear": 1,
        "resampled": 2,
        "branched": 2,
        "compacted": 2,
        "failed": 1,
        "length": 1,
    }
    assert captured["failed"].result.status == "failed" and not captured["failed"].ok
    assert all(r.ok for shape, r in captured.items() if shape != "failed")
    assert captured["compacted"].result.unbridged_calls >= 1


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "failed"])
def test_path_rows_are_the_samples_with_experts_and_masks_aligned(
    captured: dict[str, RolloutResult], shape: str
) -> None:
    result = captured[shape]
    rows = one(result)
    assert len(rows) == len(result.result.samples)
    for row, sample in zip(rows, result.result.samples, strict=True):
        check_equal_to_sample(row, sample)
        check_aligned(row)
        assert row.trajectory_id == result.trajectory_id and row.instance_id == shape


def test_step_rows_of_a_linear_trajectory_rebuild_its_one_path_row(
    captured: dict[str, RolloutResult], engine: ScriptedEngine
) -> None:
    result = captured["linear"]
    (path_row,) = one(result)
    steps = one(result, "step")
    prompts = requests_of(engine, result.trajectory_id)
    assert len(steps) == len(prompts) == 3
    assert [s.finish_reason for s in steps] == ["tool_calls", "tool_calls", "stop"]
    stitched = np.zeros(len(path_row), dtype=np.int8)
    for step, prompt in zip(steps, prompts, strict=True):
        n = len(step)
        assert step.input_ids[: step.prompt_length].tolist() == prompt  # the call's own prompt
        assert step.input_ids.tolist() == path_row.input_ids[:n].tolist()
        assert np.array_equal(step.logprobs, path_row.logprobs[:n])
        assert len(step.targets) == 1 and step.trained_tokens == n - step.prompt_length
        check_aligned(step)
        stitched[:n] += step.loss_mask
    assert stitched.tolist() == path_row.loss_mask.tolist()  # each sampled token trained once
    assert len(steps[-1]) == len(path_row)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "failed"])
def test_each_step_row_holds_its_call_s_prompt_exactly_as_the_engine_saw_it(
    captured: dict[str, RolloutResult], engine: ScriptedEngine, shape: str
) -> None:
    result = captured[shape]
    steps = one(result, "step")
    prompts = [s.input_ids[: s.prompt_length].tolist() for s in steps]
    assert prompts == requests_of(engine, result.trajectory_id)
    for step in steps:
        check_aligned(step)


@pytest.mark.parametrize("shape", ["resampled", "branched", "compacted"])
def test_forked_trajectories_train_shared_calls_once_and_final_takes_the_last_path(
    captured: dict[str, RolloutResult], shape: str
) -> None:
    result = captured[shape]
    rows = one(result)
    steps = one(result, "step")
    (final,) = one(result, "final")
    trained = {t for row in rows for t in row.targets}
    assert sorted(trained) == sorted(t for s in steps for t in s.targets)  # every call once
    assert sum(r.trained_tokens for r in rows) == sum(s.trained_tokens for s in steps)
    # The final path is the one through the latest call; every model node on it trains.
    last = rows[-1]
    assert final.leaf == last.leaf and final.input_ids.tolist() == last.input_ids.tolist()
    on_final = [s for s in steps if s.targets[0] in final.targets]
    assert final.trained_tokens == sum(s.trained_tokens for s in on_final)
    check_aligned(final)
    if shape == "branched":  # the first call is shared: trained by the first row only
        shared = rows[0].targets[0]
        assert shared not in rows[1].targets and shared in final.targets
        assert final.trained_tokens > last.trained_tokens
    batch = compose([result])
    assert batch.metrics["forks"] == 1 and batch.metrics["forked_trajectories"] == 1


def test_a_length_stopped_call_is_a_step_row_with_its_finish_reason(
    captured: dict[str, RolloutResult],
) -> None:
    steps = one(captured["length"], "step")
    assert steps[0].finish_reason == "length" and steps[0].trained_tokens == 6
    assert [s.finish_reason for s in steps[1:]] == ["tool_calls", "tool_calls", "stop"]
    for step in steps:
        check_aligned(step)


def test_a_failed_trajectory_keeps_its_rows_masked_as_an_error(
    captured: dict[str, RolloutResult],
) -> None:
    result = captured["failed"]
    batch = compose([result])
    (row,) = batch.rows
    sample = result.result.samples[0]
    assert row.input_ids.tolist() == sample.input_ids and sum(sample.loss_mask) > 0
    assert row.masked == "error" and row.trained_tokens == 0
    assert np.array_equal(row.routed_experts, sample.routed_experts)
    assert row.sampling_mask_rows() == sample.sampling_mask
    assert batch.metrics["masked/error"] == 1 and batch.metrics["trained_tokens"] == 0
    assert batch.trajectory_rewards == {} and batch.trained() == []


@pytest.mark.parametrize("how", ["mask", "cut", "drop"])
def test_truncation_to_max_seq_len(captured: dict[str, RolloutResult], how: str) -> None:
    result = captured["linear"]
    (full,) = one(result)
    limit = full.prompt_length + 5  # inside the first reply
    batch = compose([result], policy=Policy(max_seq_len=limit, truncation=how))
    if how == "drop":
        assert batch.rows == [] and batch.metrics["dropped_rows"] == 1
        return
    (row,) = batch.rows
    assert len(row) == limit and row.truncated and batch.metrics["truncated_rows"] == 1
    assert row.input_ids.tolist() == full.input_ids[:limit].tolist()
    assert row.routed_experts.shape[0] == limit and len(row.sampling_mask_rows()) == limit
    assert row.sampling_mask_rows() == full.sampling_mask_rows()[:limit]
    if how == "mask":
        assert row.trained_tokens == 0 and row.masked == "truncated"
    else:
        assert row.loss_mask.tolist() == full.loss_mask[:limit].tolist() and row.trained_tokens == 5
        assert row.masked is None


def group(
    result: RolloutResult, outcomes: list[tuple[float, str]], key: str = "g"
) -> list[RolloutResult]:
    """Copies of a real capture as one group whose rollouts ended as `outcomes` say."""
    return [
        dataclasses.replace(
            result,
            instance_id=key,
            repetition_id=i,
            rollout=Rollout(reward, stop),
            error="harness failed" if stop == "error" else None,
        )
        for i, (reward, stop) in enumerate(outcomes)
    ]


def masks_of(results: list[RolloutResult], **policy: Any) -> list[tuple[str | None, float]]:
    batch = compose(results, policy=Policy(**policy))
    return [(row.masked, row.reward) for row in batch.rows]


def test_context_length_trains_with_reward_zero_or_is_masked(
    captured: dict[str, RolloutResult],
) -> None:
    results = group(captured["linear"], [(1.0, "context_length"), (1.0, "complete")])
    assert masks_of(results) == [(None, 0.0), (None, 1.0)]
    assert masks_of(results, context_length="mask") == [("context_length", 1.0), (None, 1.0)]
    batch = compose(results)
    assert batch.metrics["zero_reward/context_length"] == 1
    assert batch.rows[0].trained_tokens > 0


def test_timeouts_are_masked_and_a_slow_group_is_masked_whole_past_the_threshold(
    captured: dict[str, RolloutResult],
) -> None:
    outcomes = [
        (0.0, "agent_timeout"),
        (0.0, "agent_timeout"),
        (1.0, "complete"),
        (0.0, "complete"),
    ]
    results = group(captured["linear"], outcomes)
    assert [m for m, _ in masks_of(results)] == ["agent_timeout", "agent_timeout", None, None]
    assert [m for m, _ in masks_of(results, timeouts="train")] == [None] * 4
    assert [m for m, _ in masks_of(results, timeout_threshold=0.5)] == [
        "agent_timeout",
        "agent_timeout",
        "group_timeout",
        "group_timeout",
    ]
    assert [m for m, _ in masks_of(results, timeout_threshold=0.75)][2:] == [None, None]
    batch = compose(results)
    assert batch.trajectory_rewards == {"g": {captured["linear"].trajectory_id: 0.0}}


def test_an_errored_rollout_is_masked_alone_unless_its_group_is_asked_for(
    captured: dict[str, RolloutResult],
) -> None:
    results = group(captured["linear"], [(0.0, "error"), (1.0, "complete")]) + group(
        captured["linear"], [(1.0, "complete")], key="other"
    )
    assert [m for m, _ in masks_of(results)] == ["error", None, None]
    assert [m for m, _ in masks_of(results, errors="group")] == ["error", "group_error", None]
    metrics = compose(results, policy=Policy(errors="group")).metrics
    assert metrics["masked/error"] == 1 and metrics["masked/group_error"] == 1
    assert metrics["masked_trajectories"] == 2


def test_forks_in_a_harness_declared_append_only(captured: dict[str, RolloutResult]) -> None:
    results = [captured["linear"], captured["branched"]]
    assert [m for m, _ in masks_of(results)] == [None, None, None]
    assert [m for m, _ in masks_of(results, forks="mask")] == [None, "fork", "fork"]
    assert masks_of(results, forks="zero_reward") == [(None, 1.0), (None, 0.0), (None, 0.0)]


def test_batch_metrics_groups_and_padded_arrays(captured: dict[str, RolloutResult]) -> None:
    results = [captured[s] for s in SHAPES]
    batch = compose(results)
    m = batch.metrics
    assert m["trajectories"] == 6 and m["rows"] == 9
    assert m["forks"] == 3 and m["forked_trajectories"] == 3
    assert m["num_unbridged_calls"] == sum(r.result.unbridged_calls for r in results)
    assert m["num_unbridged_trajectories"] == sum(1 for r in results if r.result.unbridged_calls)
    assert m["trained_tokens"] == sum(row.trained_tokens for row in batch.rows)
    assert m["masked/error"] == 1 and m["masked_rows"] == 1
    assert list(batch.groups()) == list(SHAPES)
    padded = batch.padded(pad_token_id=-1)
    trained = batch.trained()
    width = max(len(r) for r in trained)
    assert padded["input_ids"].shape == (len(trained), width)
    assert padded["routed_experts"].shape == (len(trained), width, LAYERS, TOP_K)
    for i, row in enumerate(trained):
        n = len(row)
        assert padded["input_ids"][i, :n].tolist() == row.input_ids.tolist()
        assert (padded["input_ids"][i, n:] == -1).all() and padded["attention_mask"][i].sum() == n
        assert padded["loss_mask"][i].sum() == row.trained_tokens


def test_step_and_final_rows_need_the_record(
    captured: dict[str, RolloutResult], records: Path, tmp_path: Path
) -> None:
    result = captured["linear"]
    assert len(compose([result], "step", record_dir=records).rows) == 3
    unrecorded = dataclasses.replace(result, result=dataclasses.replace(result.result, record=None))
    with pytest.raises(ValueError, match="has none: run the capture server with a record_dir"):
        compose([unrecorded], "final")
    with pytest.raises(ValueError, match="cannot read the record of .* pass compose\\(record_dir"):
        compose([result], "step", record_dir=tmp_path)
    assert len(compose([unrecorded]).rows) == 1  # path rows come from the finish alone


def test_text_mode_captures_and_bad_arguments_are_refused() -> None:
    text = FinishResult(
        id="tr_0000000000000000",
        status="finished",
        samples=[Sample(leaf=1, path=[0, 1], messages=[{}, {}], targets=[1])],
    )
    result = RolloutResult(0, 0, Rollout(1.0), text, 1, "t")
    with pytest.raises(ValueError, match="captured in text mode .* mode='tokens'"):
        compose([result])
    with pytest.raises(ValueError, match="compose mode must be one of path, step, final"):
        compose([result], "paths")
    with pytest.raises(ValueError, match="Policy.truncation must be one of 'mask', 'cut', 'drop'"):
        Policy(truncation="clip")
    with pytest.raises(ValueError, match="timeout_threshold must be in"):
        Policy(timeout_threshold=1.5)
    with pytest.raises(TypeError, match="not a RolloutResult"):
        compose([text])  # type: ignore[list-item]


def test_a_rollout_with_no_finish_is_counted_but_has_no_rows() -> None:
    lost = RolloutResult(0, 0, Rollout(0.0, "error", {"error": "x"}), None, 2, "a", "create failed")
    batch = compose([lost], "step")
    assert batch.rows == [] and batch.metrics["masked/error"] == 1
    assert batch.metrics["trajectories"] == 1 and batch.metrics["retried_rollouts"] == 1

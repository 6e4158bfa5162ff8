"""The rollout loop against a real token-mode server: grouping meta, retries on fresh
trajectories under faults (raises, hangs, captures nothing, 410 mid-rollout), checks, the
RecordLog, and no trajectory left open."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from rollout_agents import client_for, episode
from server_fixtures import Control, ServerThread

from skycap import CapturePool
from skycap.compose import compose
from skycap.mock.engine import ScriptedEngine
from skycap.rollout import Rollout, RolloutResult, RolloutRunner
from skycap.rollout.progress import BatchProgress

SAMPLING = {"temperature": 0.8, "max_tokens": 256}


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rollout-records")


@pytest.fixture(scope="module")
def server(token_server_options: Callable[..., Any], records: Path) -> Iterator[ServerThread]:
    thread = ServerThread(token_server_options(record_dir=records))
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture
def pool(server: ServerThread) -> Iterator[CapturePool]:
    client = CapturePool([server.url])
    yield client
    asyncio.run(client.close())


@pytest.fixture(autouse=True)
def nothing_left_open(server: ServerThread, scripted_engine: ScriptedEngine) -> Iterator[None]:
    """After every test: no trajectory is still open on the server, no fault is pending."""
    yield
    scripted_engine.clear_faults()
    health = server.run_in_loop(lambda: server.store.health())
    assert health["open_trajectories"] == 0, health


def documents(server: ServerThread, ids: list[str]) -> list[dict[str, Any]]:
    with Control(server.url) as control:
        return [control.document(i).json() for i in ids]


class Agent(RolloutRunner):
    """The tool-using agent; `behave(prompt, attempt_no)` may return a hook or raise first."""

    def __init__(self, pool: CapturePool, behave: Callable[..., Any] | None = None, **kw: Any):
        super().__init__(pool, **kw)
        self.behave = behave
        self.calls: list[dict[str, Any]] = []
        self.active = 0
        self.most_active = 0

    async def run_rollout(
        self, prompt: Any, *, base_url: str, api_key: str, sampling: dict[str, Any], env: Any
    ) -> Rollout:
        self.calls.append({"prompt": prompt, "base_url": base_url, "sampling": sampling})
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        client = client_for(base_url, api_key)
        try:
            hook = None
            if self.behave is not None:
                hook = await self.behave(prompt, len(self.calls) - 1, client)
                if isinstance(hook, Rollout):
                    return hook
            task = prompt["question"] if isinstance(prompt, dict) else str(prompt)
            answer, turns = await episode(client, task, sampling, hook=hook)
            return Rollout(1.0 if answer.startswith("Done") else 0.0, annotations={"turns": turns})
        finally:
            self.active -= 1
            await client.close()


def test_generate_is_prompt_major_and_puts_the_grouping_keys_in_meta(
    server: ServerThread, pool: CapturePool
) -> None:
    prompts = [{"instance_id": "alpha", "task": "notes", "question": "Find alpha."}, "Find beta."]
    runner = Agent(pool)
    results = asyncio.run(runner.generate(prompts, repeats=2, step=7, sampling=SAMPLING))

    assert [(r.prompt_index, r.repetition_id) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r.instance_id for r in results] == ["alpha", "alpha", "1", "1"]
    assert all(r.ok and r.attempts == 1 and r.result.status == "finished" for r in results)
    assert all(r.rollout.reward == 1.0 and r.rollout.annotations == {"turns": 3} for r in results)
    assert all(call["sampling"] == SAMPLING for call in runner.calls)  # handed over, unchanged
    docs = documents(server, [r.trajectory_id for r in results])
    keys = {"attempt": 0, "step": 7, "phase": "train"}
    assert [d["meta"] for d in docs] == [
        {"task": "notes", "instance_id": "alpha", "repetition_id": 0, **keys},
        {"task": "notes", "instance_id": "alpha", "repetition_id": 1, **keys},
        {"instance_id": "1", "repetition_id": 0, **keys},
        {"instance_id": "1", "repetition_id": 1, **keys},
    ]
    assert all(
        d["annotations"] == {"reward": 1.0, "stop_reason": "complete", "turns": 3} for d in docs
    )
    log = runner.record_log
    assert log.phases() == ["train"] and log.steps("train") == [7]
    rows = log.rows("train", 7, trained_ids={results[0].trajectory_id})
    assert [row["id"] for row in rows] == [r.trajectory_id for r in results]
    assert rows[0]["trained"] is True and rows[1]["trained"] is False
    assert rows[0]["record"]["path"].endswith(f"{rows[0]['id']}.json.zst")
    assert rows[0]["annotations"] == {"reward": 1.0, "stop_reason": "complete", "turns": 3}
    assert not any(row["superseded"] for row in rows)


def check_retried(
    server: ServerThread, runner: Agent, result: RolloutResult, first_error: str
) -> dict[str, Any]:
    """The result counts from attempt 1; attempt 0 is superseded, finished with its reason."""
    assert result.ok and result.attempts == 2, result.error
    first, second = runner.record_log.entries()
    assert first.superseded and not second.superseded
    assert (first.attempt, second.attempt) == (0, 1)
    assert first.id != second.id == result.trajectory_id  # a fresh trajectory
    assert first_error in first.error
    old, new = documents(server, [first.id, second.id])
    assert old["ended"] and old["meta"]["attempt"] == 0 and new["meta"]["attempt"] == 1
    # The superseded attempt is never trained: not composed, and not `trained` in an index.
    assert {row.trajectory_id for row in compose([result]).rows} == {second.id}
    trained = {
        row["id"]: row["trained"]
        for row in runner.record_log.rows("train", 0, {first.id, second.id})
    }
    assert trained == {first.id: False, second.id: True}
    return old


def test_a_harness_that_raises_is_retried_on_a_fresh_trajectory(
    server: ServerThread, pool: CapturePool
) -> None:
    async def behave(prompt: Any, attempt: int, client: Any) -> Any:
        if attempt == 0:
            await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": prompt}]
            )
            raise RuntimeError("sandbox crashed")
        return None

    runner = Agent(pool, behave=behave)
    (result,) = asyncio.run(runner.generate(["Find gamma."]))
    old = check_retried(server, runner, result, "RuntimeError: sandbox crashed")
    assert old["status"] == "finished"
    assert old["annotations"] == {
        "reward": 0.0,
        "stop_reason": "error",
        "error": "RuntimeError: sandbox crashed",
    }
    assert len(old["nodes"]) == 2  # what it captured before it raised is kept in its record


def test_a_harness_that_hangs_past_its_timeout_is_cancelled_and_retried(
    server: ServerThread, pool: CapturePool
) -> None:
    never = asyncio.Event

    async def behave(prompt: Any, attempt: int, client: Any) -> Any:
        if attempt == 0:
            await never().wait()
        return None

    runner = Agent(pool, behave=behave, timeout=6)
    (result,) = asyncio.run(runner.generate(["Find delta."]))
    old = check_retried(server, runner, result, "ran past its 6 s timeout")
    assert old["annotations"]["stop_reason"] == "agent_timeout"
    assert old["annotations"]["error"] == "the rollout ran past its 6 s timeout"


def test_a_rollout_that_captured_no_call_fails_every_attempt(
    server: ServerThread, pool: CapturePool
) -> None:
    async def behave(prompt: Any, attempt: int, client: Any) -> Any:
        return Rollout(1.0)  # never called the model

    runner = Agent(pool, behave=behave, attempts=3)
    (result,) = asyncio.run(runner.generate(["Find epsilon."]))
    assert not result.ok and result.attempts == 3
    assert "no model call was captured" in result.error
    assert result.rollout.reward == 1.0 and result.result.samples == []
    entries = runner.record_log.entries()
    assert [e.superseded for e in entries] == [True, True, False]
    assert len({e.id for e in entries}) == 3
    assert all(e.status == "finished" for e in entries)


@pytest.mark.parametrize("harness_raises", [True, False])
def test_a_410_mid_rollout_retries_on_a_fresh_trajectory(
    server: ServerThread, pool: CapturePool, scripted_engine: ScriptedEngine, harness_raises: bool
) -> None:
    """The first call's experts are unusable: the trajectory is sealed `failed` and the next
    call gets 410. The harness raises on it, or swallows it and reports completion; either
    way the failed trajectory is superseded."""
    seen: list[int] = []

    async def behave(prompt: Any, attempt: int, client: Any) -> Any:
        if attempt:
            return None

        def hook(call: int, messages: list[dict[str, Any]]) -> None:
            if call == 0:
                scripted_engine.fail_next("experts_coverage")

        async def run() -> Rollout:
            try:
                await episode(client, prompt, {}, hook=hook)
            except openai.APIStatusError as exc:
                seen.append(exc.status_code)
                if harness_raises:
                    raise
            return Rollout(0.5)

        return await run()

    runner = Agent(pool, behave=behave, concurrency=1)
    (result,) = asyncio.run(runner.generate(["Find zeta."]))
    assert seen == [410]
    old = check_retried(
        server,
        runner,
        result,
        "Error code: 410" if harness_raises else "the trajectory ended failed",
    )
    assert old["status"] == "failed" and runner.record_log.entries()[0].status == "failed"
    stop = "error" if harness_raises else "complete"  # as the harness reported it
    assert old["annotations"]["stop_reason"] == stop


def test_stop_reason_error_is_retried_and_the_last_failure_is_reported(
    server: ServerThread, pool: CapturePool
) -> None:
    async def behave(prompt: Any, attempt: int, client: Any) -> Any:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": prompt}]
        )
        return Rollout(0.0, "error", {"error": f"tool server down ({attempt})"})

    runner = Agent(pool, behave=behave)
    (result,) = asyncio.run(runner.generate(["Find eta."]))
    assert not result.ok and result.attempts == 2 and result.error == "tool server down (1)"
    assert result.result.status == "finished" and len(result.result.samples) == 1


def test_require_masks_fails_a_capture_without_sampling_masks(
    server: ServerThread, pool: CapturePool
) -> None:
    runner = Agent(pool, require_experts=True, require_masks=True, attempts=1)
    (result,) = asyncio.run(runner.generate(["Find theta."]))
    assert result.attempts == 1 and "sampling masks are missing" in result.error
    (sample,) = result.result.samples
    assert sample.routed_experts is not None and sample.sampling_mask is None
    experts_only = Agent(pool, require_experts=True)
    (kept,) = asyncio.run(experts_only.generate(["Find theta."]))
    assert kept.ok


def test_concurrency_bounds_the_rollouts_in_flight(pool: CapturePool) -> None:
    runner = Agent(pool, concurrency=2)
    results = asyncio.run(runner.generate([f"Find item {i}." for i in range(3)], repeats=2))
    assert len(results) == 6 and all(r.ok for r in results)
    assert 1 <= runner.most_active <= 2


def test_a_cancelled_batch_finishes_every_trajectory_it_opened(
    server: ServerThread, pool: CapturePool, scripted_engine: ScriptedEngine
) -> None:
    started: list[str] = []
    all_started = asyncio.Event()

    async def behave(prompt: Any, attempt: int, client: Any) -> Any:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": prompt}]
        )
        started.append(prompt)
        if len(started) == 3:
            all_started.set()
        await asyncio.Event().wait()

    async def main() -> Agent:
        runner = Agent(pool, behave=behave)
        batch = asyncio.create_task(runner.generate(["a", "b", "c"]))
        await asyncio.wait_for(all_started.wait(), timeout=20)
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        return runner

    runner = asyncio.run(main())
    ids = [e.id for e in runner.record_log.entries()]
    assert len(ids) == 3
    docs = documents(server, ids)
    assert all(d["ended"] and d["annotations"] == {"error": "CancelledError"} for d in docs)
    assert all(len(d["nodes"]) == 2 for d in docs)


def test_a_server_that_cannot_be_reached_fails_each_attempt_at_create() -> None:
    async def main() -> tuple[list[RolloutResult], Agent]:
        async with CapturePool(["http://127.0.0.1:9"], timeout=5) as dead:
            runner = Agent(dead)
            return await runner.generate(["x"]), runner

    (result,), runner = asyncio.run(main())
    assert result.attempts == 2 and result.result is None
    assert result.error.startswith("create failed: no capture server reachable")
    assert result.rollout.stop_reason == "error"
    assert [e.id for e in runner.record_log.entries()] == [None, None]
    assert runner.record_log.rows("train", 0) == []


def test_bad_arguments_are_refused_with_what_to_do(pool: CapturePool) -> None:
    with pytest.raises(ValueError, match="same instance_id 'a'"):
        asyncio.run(Agent(pool).generate([{"instance_id": "a"}, {"instance_id": "a"}]))
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        asyncio.run(Agent(pool).generate(["x"], repeats=0))
    with pytest.raises(ValueError, match="attempts must be an integer >= 1"):
        Agent(pool, attempts=0)
    with pytest.raises(ValueError, match="stop_reason must be one of complete"):
        Rollout(1.0, "done")
    with pytest.raises(ValueError, match="may not set reward"):
        Rollout(1.0, annotations={"reward": 2.0})
    with pytest.raises(ValueError, match="must be finite"):
        Rollout(float("nan"))


def test_the_progress_bar_draws_only_on_a_terminal_unless_asked() -> None:
    assert BatchProgress("train step 0", 3)._progress is None  # stderr here is no terminal
    with BatchProgress("train step 0", 3, enabled=True) as shown:
        shown.retried()
        shown.done(True)
        shown.done(False)
        (task,) = shown._progress.tasks
        assert task.completed == 2 and task.total == 3
        assert task.fields["detail"] == "1 retried, 1 failed"

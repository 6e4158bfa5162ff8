"""The shared rollout loop: a RolloutRunner subclass runs one harness; the loop does the rest.

A harness author writes `run_rollout` (point the agent at `base_url`/`api_key`, apply
`sampling`, return a `Rollout`); `generate` runs it for every prompt and repetition over a
CapturePool with a concurrency limit, a timeout per rollout and retries on fresh
trajectories, finishes every trajectory it opened (failed attempts with their reason, so
nothing is left open) and checks what was captured before a rollout counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import numbers
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from skycap.client import CaptureError, CapturePool, FinishResult, Trajectory
from skycap.rollout.log import AttemptRecord, RecordLog
from skycap.rollout.progress import BatchProgress

__all__ = ["STOP_REASONS", "Rollout", "RolloutResult", "RolloutRunner"]

logger = logging.getLogger("skycap.rollout")

#: How a rollout ended, as the harness reports it (annotation `stop_reason`).
STOP_REASONS = ("complete", "agent_timeout", "error", "context_length")
_RESERVED = ("reward", "stop_reason")
_ERROR_LIMIT = 500


@dataclass
class Rollout:
    """What a harness returns: its reward, how it ended, and any other annotations.

    `annotations` are sent to `finish` beside `reward` and `stop_reason` (so they may not
    use those two names) and must be JSON-serialisable.
    """

    reward: float
    stop_reason: str = "complete"
    annotations: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        reward = self.reward
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise TypeError(f"Rollout.reward must be a number, got {reward!r:.80}")
        if not math.isfinite(reward):
            raise ValueError(f"Rollout.reward must be finite, got {reward!r}")
        self.reward = float(reward)
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(
                f"Rollout.stop_reason must be one of {', '.join(STOP_REASONS)}, "
                f"got {self.stop_reason!r}"
            )
        if not isinstance(self.annotations, Mapping):
            raise TypeError(
                f"Rollout.annotations must be a mapping, got {type(self.annotations).__name__}"
            )
        self.annotations = dict(self.annotations)
        clash = [key for key in _RESERVED if key in self.annotations]
        if clash:
            raise ValueError(
                f"Rollout.annotations may not set {', '.join(clash)}: pass them as "
                "Rollout(reward=..., stop_reason=...)"
            )

    def finish_annotations(self) -> dict[str, Any]:
        """The annotations `finish` records: reward, stop reason, then the rest."""
        return {"reward": self.reward, "stop_reason": self.stop_reason, **self.annotations}


@dataclass
class RolloutResult:
    """One prompt and repetition after the loop: its counting attempt, or its last failed one.

    `error` is None when the rollout counts; otherwise it says why the last attempt did
    not (then `rollout` is what the harness returned, or a stand-in with stop reason
    `error` / `agent_timeout` when it raised or ran past its timeout). `result` is that
    attempt's finish answer (None when no finish was answered). `attempts` counts the
    trajectories opened for it; the superseded ones are in the runner's `record_log`.
    """

    prompt_index: int
    repetition_id: int
    rollout: Rollout
    result: FinishResult | None
    attempts: int
    instance_id: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def trajectory_id(self) -> str | None:
        return None if self.result is None else self.result.id


@dataclass
class _Job:
    index: int
    prompt: Any
    instance_id: str
    task: str | None
    repetition: int
    step: int
    phase: str
    sampling: dict[str, Any]


@dataclass
class _Outcome:
    rollout: Rollout
    result: FinishResult | None
    error: str | None


class RolloutRunner:
    """Subclass it and implement `run_rollout`; `generate` is the shared loop.

    Class attributes a subclass may set: `task` (the `task` meta key when a prompt does not
    name one) and `paths` (the finish's path rule, `"all"` by default).
    """

    task: str | None = None
    paths: str = "all"

    def __init__(
        self,
        pool: CapturePool,
        *,
        concurrency: int = 64,
        timeout: float | None = None,
        attempts: int = 2,
        require_experts: bool = False,
        require_masks: bool = False,
        progress: bool | None = None,
    ) -> None:
        """`timeout` bounds one attempt in seconds (None: no bound); `attempts` counts the
        first try. `require_experts` / `require_masks` fail a capture whose samples lack
        routed experts / sampling masks. `progress` draws a bar on the terminal (None: only
        when stderr is a terminal)."""
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"attempts must be an integer >= 1, got {attempts!r}")
        if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be None or seconds > 0, got {timeout!r}")
        self.pool = pool
        self.concurrency = concurrency
        self.timeout = None if timeout is None else float(timeout)
        self.attempts = attempts
        self.require_experts = require_experts
        self.require_masks = require_masks
        self.progress = progress
        self.record_log = RecordLog()

    async def run_rollout(
        self,
        prompt: Any,
        *,
        base_url: str,
        api_key: str,
        sampling: dict[str, Any],
        env: dict[str, str],
    ) -> Rollout:
        """Run the harness once on `prompt` and return its Rollout.

        Point the agent's client at `base_url` with `api_key` (or, for a subprocess in proxy
        mode, add `env` to its environment) and apply `sampling` yourself: skycap does not
        rewrite requests. Raising, or returning stop reason `error`, makes the loop retry
        on a fresh trajectory. Keep it cancellable: the timeout cancels it.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement async run_rollout()")

    async def generate(
        self,
        prompts: Iterable[Any],
        repeats: int = 1,
        step: int = 0,
        phase: str = "train",
        *,
        sampling: Mapping[str, Any] | None = None,
    ) -> list[RolloutResult]:
        """Run every prompt `repeats` times; results are prompt-major (prompt 0's repeats first).

        A prompt that is a mapping may name its `instance_id` and `task`; otherwise the
        instance id is the prompt's index. Each attempt is listed in `record_log`.
        """
        prompts = list(prompts)
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
        _check_step(step, phase)
        params = dict(sampling or {})
        jobs = []
        seen: dict[str, int] = {}
        for index, prompt in enumerate(prompts):
            instance_id = _instance_id(prompt, index)
            if instance_id in seen:
                raise ValueError(
                    f"prompts {seen[instance_id]} and {index} have the same instance_id "
                    f"{instance_id!r}; give each prompt its own, or pass it once with more repeats"
                )
            seen[instance_id] = index
            task = _task(prompt) or self.task
            for repetition in range(repeats):
                jobs.append(_Job(index, prompt, instance_id, task, repetition, step, phase, params))
        return await self._run(jobs, step, phase)

    async def generate_entries(
        self,
        entries: Iterable[tuple[Any, str, int]],
        step: int = 0,
        phase: str = "train",
        *,
        sampling: Mapping[str, Any] | None = None,
    ) -> list[RolloutResult]:
        """One rollout per `(prompt, instance_id, repetition_id)`, in the order given, for a
        trainer that expanded repetitions itself (SkyRL does); `prompt_index` is the entry's
        position. The loop, its retries and `record_log` are those of `generate`.
        """
        _check_step(step, phase)
        params = dict(sampling or {})
        jobs = []
        seen: dict[tuple[str, int], int] = {}
        for index, (prompt, instance_id, repetition) in enumerate(entries):
            if isinstance(repetition, bool) or not isinstance(repetition, int) or repetition < 0:
                raise ValueError(
                    f"entry {index}: repetition_id must be an integer >= 0, got {repetition!r}"
                )
            key = (str(instance_id), repetition)
            if key in seen:
                raise ValueError(
                    f"entries {seen[key]} and {index} are both instance {key[0]!r} repetition "
                    f"{repetition}; give each rollout its own repetition_id"
                )
            seen[key] = index
            task = _task(prompt) or self.task
            jobs.append(_Job(index, prompt, key[0], task, repetition, step, phase, params))
        return await self._run(jobs, step, phase)

    async def _run(self, jobs: list[_Job], step: int, phase: str) -> list[RolloutResult]:
        """Run the jobs under the concurrency limit; a batch cut short is marked dropped."""
        slots = asyncio.Semaphore(self.concurrency)
        opened: list[AttemptRecord] = []
        try:
            with BatchProgress(f"{phase} step {step}", len(jobs), self.progress) as progress:
                async with asyncio.TaskGroup() as group:
                    tasks = [
                        group.create_task(self._rollout(job, slots, progress, opened))
                        for job in jobs
                    ]
        except BaseException:  # cancelled or broken: the caller gets no batch to train on
            for entry in opened:
                entry.dropped = True
            raise
        return [task.result() for task in tasks]

    # -- one prompt and repetition ---------------------------------------------------------

    async def _rollout(
        self,
        job: _Job,
        slots: asyncio.Semaphore,
        progress: BatchProgress,
        opened: list[AttemptRecord],
    ) -> RolloutResult:
        for attempt in range(self.attempts):
            if attempt:
                progress.retried()
            entry = self.record_log.open(
                AttemptRecord(
                    phase=job.phase,
                    step=job.step,
                    instance_id=job.instance_id,
                    repetition_id=job.repetition,
                    attempt=attempt,
                    prompt_index=job.index,
                    meta=self._meta(job, attempt),
                )
            )
            opened.append(entry)
            async with slots:
                try:
                    outcome = await self._attempt(job, entry)
                finally:
                    entry.ended_at = time.time()
            entry.error = outcome.error
            if outcome.error is None:
                break
            if attempt + 1 < self.attempts:
                entry.superseded = True
                logger.info(
                    "rollout %s repetition %d attempt %d (%s) failed: %s; retrying on a fresh "
                    "trajectory",
                    job.instance_id,
                    job.repetition,
                    attempt,
                    entry.id,
                    outcome.error,
                )
            else:
                logger.warning(
                    "rollout %s repetition %d failed all %d attempts; the last (%s): %s",
                    job.instance_id,
                    job.repetition,
                    self.attempts,
                    entry.id,
                    outcome.error,
                )
        progress.done(outcome.error is None)
        return RolloutResult(
            prompt_index=job.index,
            repetition_id=job.repetition,
            rollout=outcome.rollout,
            result=outcome.result,
            attempts=attempt + 1,
            instance_id=job.instance_id,
            error=outcome.error,
        )

    def _meta(self, job: _Job, attempt: int) -> dict[str, Any]:
        """The grouping keys the viewer and step indexes read (task only when known)."""
        meta: dict[str, Any] = {} if job.task is None else {"task": job.task}
        meta.update(
            instance_id=job.instance_id,
            repetition_id=job.repetition,
            attempt=attempt,
            step=job.step,
            phase=job.phase,
        )
        return meta

    async def _attempt(self, job: _Job, entry: AttemptRecord) -> _Outcome:
        """One fresh trajectory: create, run the harness, finish, check.

        `pool.trajectory` finishes the trajectory whatever happens in the block (a finish
        that failed is re-sent once; cancellation finishes it with the error's name).
        """
        rollout: Rollout | None = None
        try:
            async with self.pool.trajectory(entry.meta, paths=self.paths) as trajectory:
                entry.id = trajectory.id
                rollout, failure = await self._harness(job, trajectory)
                entry.annotations = rollout.finish_annotations()
                result = await trajectory.finish(entry.annotations)
        except CaptureError as exc:
            stage = "finish" if rollout is not None else "create"
            error = f"{stage} failed: {exc.message}"
            return _Outcome(rollout or _stand_in("error", error), None, error)
        entry.status = result.status
        entry.record = result.record
        return _Outcome(rollout, result, failure or self._problem(rollout, result))

    async def _harness(self, job: _Job, trajectory: Trajectory) -> tuple[Rollout, str | None]:
        """The harness's Rollout, or a stand-in and the reason when it raised or timed out."""
        scope = asyncio.timeout(self.timeout)
        try:
            async with scope:
                rollout = await self.run_rollout(
                    job.prompt,
                    base_url=trajectory.base_url,
                    api_key=trajectory.api_key,
                    sampling=dict(job.sampling),
                    env=dict(trajectory.env or {}),
                )
        except TimeoutError as exc:
            if scope.expired():
                error = f"the rollout ran past its {self.timeout:g} s timeout"
                return _stand_in("agent_timeout", error), error
            error = _describe(exc)
            return _stand_in("error", error), error
        except Exception as exc:  # the harness is user code: any failure is a failed attempt
            logger.debug("rollout %s raised", trajectory.id, exc_info=True)
            error = _describe(exc)
            return _stand_in("error", error), error
        if not isinstance(rollout, Rollout):
            error = f"run_rollout returned {type(rollout).__name__}, not a Rollout"
            return _stand_in("error", error), error
        try:
            json.dumps(rollout.finish_annotations(), allow_nan=False)
        except (TypeError, ValueError) as exc:
            error = f"the Rollout's annotations are not JSON-serialisable: {exc}"
            return _stand_in("error", error), error
        return rollout, None

    def _problem(self, rollout: Rollout, result: FinishResult) -> str | None:
        """Why a finished attempt does not count, or None."""
        if rollout.stop_reason == "error":
            return str(
                rollout.annotations.get("error") or "the harness reported stop_reason 'error'"
            )
        if result.status != "finished":
            why = (
                ": a turn's tokens could not be committed exactly (its record lists the failure)"
                if result.status == "failed"
                else ""
            )
            return f"the trajectory ended {result.status}{why}"
        calls = getattr(result, "calls", None)  # servers that report committed calls
        empty = calls == 0 if isinstance(calls, int) else not result.samples
        if empty and rollout.stop_reason != "context_length":
            return (
                "no model call was captured: point the harness at the base_url it was given "
                "(or add env to its environment)"
            )
        if self.require_experts and any(s.routed_experts is None for s in result.samples):
            return (
                "routed experts are missing from the capture (require_experts=True): "
                "token mode with an engine that returns them is needed"
            )
        if self.require_masks and any(s.sampling_mask is None for s in result.samples):
            return (
                "sampling masks are missing from the capture (require_masks=True): "
                "token mode with sampling_mask=True is needed"
            )
        return None


def _check_step(step: Any, phase: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if not isinstance(phase, str) or not phase:
        raise ValueError(f"phase must be a non-empty string such as 'train', got {phase!r}")


def _stand_in(stop_reason: str, error: str) -> Rollout:
    return Rollout(0.0, stop_reason, {"error": error})


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:_ERROR_LIMIT]


def _instance_id(prompt: Any, index: int) -> str:
    if isinstance(prompt, Mapping) and prompt.get("instance_id") is not None:
        value = prompt["instance_id"]
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ValueError(f"prompt {index}: instance_id must be a string, got {value!r:.80}")
        return str(value)
    return str(index)


def _task(prompt: Any) -> str | None:
    if isinstance(prompt, Mapping) and isinstance(prompt.get("task"), str):
        return prompt["task"]
    return None

"""SkycapGenerator: SkyRL's `GeneratorInput` through skycap's rollout loop and composer into its
`GeneratorOutput`, and the step hook that indexes what the trainer trained (docs/skyrl.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from skycap.client import CapturePool
from skycap.compose import MODES, Policy, compose
from skycap.index import RecordIndex
from skycap.integrations.skyrl_output import generator_output, trajectory_id_class
from skycap.rollout import RolloutResult, RolloutRunner

__all__ = ["SkycapGenerator", "openai_sampling"]

DEFAULT_POLICY = Policy()
#: Chat Completions parameters of SkyRL's (vLLM-shaped) sampling params, passed as keywords.
OPENAI_PARAMS = ("max_tokens", "temperature", "top_p", "stop", "seed", "n")
#: What the capture server decides for itself: how tokens are decoded and that logprobs come.
SERVER_PARAMS = ("skip_special_tokens", "include_stop_str_in_output", "logprobs")


def openai_sampling(sampling: Mapping[str, Any] | None) -> dict[str, Any]:
    """SkyRL's `sampling_params` (vLLM's names) as openai SDK keywords: the Chat Completions
    ones as they are, vLLM's others (`top_k`, `min_p`, `min_tokens`, …) in `extra_body`,
    unset ones and what the capture server decides (decoding, logprobs) left out."""
    given = {k: v for k, v in (sampling or {}).items() if v is not None}
    kwargs = {k: given[k] for k in OPENAI_PARAMS if k in given}
    extra = {k: v for k, v in given.items() if k not in OPENAI_PARAMS and k not in SERVER_PARAMS}
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


class SkycapGenerator(RolloutRunner):
    """A RolloutRunner whose `generate` takes SkyRL's `GeneratorInput` and returns its
    `GeneratorOutput`; subclass it, write `run_rollout`, and mix in SkyRL's
    `GeneratorInterface`.

    `mode` is the row mode (`"step"`: one row per model call, what SkyRL's step-wise
    training wants; `"path"`; `"final"`: one row per trajectory, for non-step-wise
    training). `policy` is the composer's (masking, overlong, timeout threshold, forks);
    `record_dir` where step and final rows read records (default: where each finish says);
    `index` logs each step from `on_step_end`.
    """

    def __init__(
        self,
        pool: CapturePool,
        *,
        mode: str = "step",
        policy: Policy = DEFAULT_POLICY,
        record_dir: str | Path | None = None,
        index: RecordIndex | None = None,
        **options: Any,
    ) -> None:
        """`options` are RolloutRunner's (`concurrency`, `timeout`, `attempts`, …)."""
        super().__init__(pool, **options)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a skycap.compose.Policy, got {type(policy).__name__}")
        if index is not None and not isinstance(index, RecordIndex):
            raise TypeError(f"index must be a skycap.index.RecordIndex, got {type(index).__name__}")
        self.mode = mode
        self.policy = policy
        self.record_dir = record_dir
        self.index = index
        # (phase, step) -> SkyRL trajectory id string -> (skycap trajectory id, trained a token)
        self._steps: dict[tuple[str, int], dict[str, tuple[str, bool]]] = {}

    async def generate(self, input_batch: Mapping[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        """SkyRL's `GeneratorInput` in, its `GeneratorOutput` out (rows in input order).

        Each entry of `prompts` is one rollout; `trajectory_ids[i]` names its instance and
        repetition, `env_extras[i]` joins the conversation in the prompt mapping
        `run_rollout` gets, `sampling_params` is its `sampling`, and `batch_metadata`
        gives the step and phase.
        """
        prompts = list(input_batch["prompts"])
        count = len(prompts)
        extras = _per_entry(input_batch.get("env_extras"), count, "env_extras")
        ids = _per_entry(input_batch.get("trajectory_ids"), count, "trajectory_ids")
        step, phase = _step_and_phase(input_batch.get("batch_metadata"))
        id_class = trajectory_id_class()
        ids = [id_class(str(i), 0) if t is None else t for i, t in enumerate(ids)]
        entries = []
        for i, (messages, extra, tid) in enumerate(zip(prompts, extras, ids, strict=True)):
            if extra is not None and not isinstance(extra, Mapping):
                raise TypeError(f"env_extras[{i}] must be a mapping, got {type(extra).__name__}")
            prompt = {"messages": messages, **(extra or {})}
            entries.append((prompt, str(tid.instance_id), int(tid.repetition_id)))
        # A batch this phase dropped unfinished (generate raised or was cancelled) is never
        # the trainer's: it goes now, not into the next step's index.
        self.record_log.discard(phase, dropped=True)
        started = time.time()
        results = await self.generate_entries(
            entries, step, phase, sampling=input_batch.get("sampling_params")
        )
        times = self._times(results, step, phase, started)
        # Composing reads and decodes every record: off the loop, which other batches share.
        output = await asyncio.to_thread(self._output, results, ids, times)
        self._remember(phase, step, results, ids, output["loss_masks"], output["is_last_step"])
        return output

    def _output(
        self, results: Sequence[RolloutResult], ids: Sequence[Any], times: Sequence[float]
    ) -> dict[str, Any]:
        batch = compose(results, self.mode, policy=self.policy, record_dir=self.record_dir)
        return generator_output(results, batch, ids, times)

    def on_step_end(
        self,
        global_step: int,
        trajectory_ids: Iterable[Any] | None = None,
        phase: str = "train",
    ) -> dict[str, Any] | None:
        """Log a step through the index: the trainer's hook, with the batch's SkyRL trajectory
        ids (None: every trajectory of the step). Trained ids are those among them with a
        trained token. Returns the step document (None without an index, or for a phase the
        index leaves out); the step's attempts leave `record_log` either way.
        """
        known = self._steps.pop((phase, global_step), {})
        if trajectory_ids is None:
            chosen = set(known)
        else:
            chosen = {_key(t) for t in trajectory_ids}
        trained = {sid for key, (sid, has) in known.items() if key in chosen and has}
        if self.index is not None:
            return self.index.log_step(global_step, phase, trained, self.record_log)
        self.record_log.discard(phase, dropped=True)
        self.record_log.discard(phase, global_step)
        return None

    def _times(
        self, results: Sequence[RolloutResult], step: int, phase: str, started: float
    ) -> list[float]:
        """Each entry's wall time, first attempt opened to last attempt ended (retries count)."""
        spans: dict[tuple[str, int], list[float]] = {}
        for attempt in self.record_log.entries(phase, step):
            if attempt.started_at < started:
                continue  # an earlier generate of the same step
            ended = attempt.ended_at if attempt.ended_at is not None else time.time()
            span = spans.setdefault((attempt.instance_id, attempt.repetition_id), [ended, ended])
            span[0] = min(span[0], attempt.started_at)
            span[1] = max(span[1], ended)
        return [
            float(end - start)
            for start, end in (
                spans.get((r.instance_id, r.repetition_id), (0.0, 0.0)) for r in results
            )
        ]

    def _remember(
        self,
        phase: str,
        step: int,
        results: Sequence[RolloutResult],
        ids: Sequence[Any],
        loss_masks: Sequence[Sequence[int]],
        last: Sequence[bool],
    ) -> None:
        """Which SkyRL id is which trajectory, and whether any of its rows trains a token."""
        trained = [False] * len(results)
        entry = 0
        for mask, is_last in zip(loss_masks, last, strict=True):
            trained[entry] = trained[entry] or any(mask)
            entry += bool(is_last)
        known = self._steps.setdefault((phase, step), {})
        for result, tid, has in zip(results, ids, trained, strict=True):
            if result.trajectory_id is not None:
                known[_key(tid)] = (result.trajectory_id, has)


def _key(trajectory_id: Any) -> str:
    """SkyRL's string form of a trajectory id (`<instance>_<repetition>`)."""
    to_string = getattr(trajectory_id, "to_string", None)
    return to_string() if callable(to_string) else str(trajectory_id)


def _per_entry(values: Sequence[Any] | None, count: int, key: str) -> list[Any]:
    if values is None:
        return [None] * count
    values = list(values)
    if len(values) != count:
        raise ValueError(f"{key} has {len(values)} entries for {count} prompts: give one each")
    return values


def _step_and_phase(metadata: Any) -> tuple[int, str]:
    """`batch_metadata`'s step and phase (SkyRL's `BatchMetadata`, a mapping, or None)."""
    if metadata is None:
        return 0, "train"
    if isinstance(metadata, Mapping):
        return int(metadata.get("global_step", 0)), str(metadata.get("training_phase", "train"))
    return int(metadata.global_step), str(metadata.training_phase)

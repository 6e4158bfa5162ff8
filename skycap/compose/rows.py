"""Training rows as numpy arrays, per row mode: `path` from the finish's samples, `step` and
`final` from the trajectory's record (which holds each call's token boundaries)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from skycap.arrays import rows_to_csr
from skycap.client import FinishResult, Sample
from skycap.loader import LoadedRecord, load
from skycap.record.reader import RecordError
from skycap.samples import BuiltSample, build_sample, rows_final, rows_from_samples_field
from skycap.weights import Span, clip_spans

__all__ = ["MODES", "TrainingRow", "cut", "graph_rows", "sample_rows"]

#: Row modes: one row per root-to-leaf path, per model call, or per trial (its final path).
MODES = ("path", "step", "final")


@dataclass(eq=False)
class TrainingRow:
    """One row for a trainer: tokens, what trains, and where it came from.

    `input_ids` int32, `loss_mask` int8 (1 on sampled tokens this row trains), `logprobs`
    float32 (the engine's, 0.0 where not sampled), `routed_experts` `[n, layers, k]` aligned
    position by position (None when not recorded), `sampling_mask` CSR over the n positions
    as `(ids int32, offsets int64)` (row p is `ids[offsets[p]:offsets[p+1]]`, empty where
    not trained; None when not recorded). `targets` are the model nodes (calls) the row
    trains and `leaf` its path's last node, in trajectory `trajectory_id`. `masked` says why
    the row trains nothing (its loss mask is then all zero); `reward` is the trajectory's
    after the policies. `weight_versions` says which policy version sampled which trained
    positions (`[{"version", "start", "end"}]`, None when not reported). Advantages are
    the trainer's.
    """

    trajectory_id: str
    instance_id: str
    prompt_index: int
    repetition_id: int
    leaf: int
    targets: tuple[int, ...]
    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    routed_experts: np.ndarray | None
    sampling_mask: tuple[np.ndarray, np.ndarray] | None
    reward: float = 0.0
    stop_reason: str = "complete"
    finish_reason: str | None = None
    truncated: bool = False
    masked: str | None = None
    weight_versions: list[Span] | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def trained_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def prompt_length(self) -> int:
        """Tokens before the first trained one: the prompt/response split some trainers want."""
        trained = np.flatnonzero(self.loss_mask)
        return int(trained[0]) if trained.size else len(self)

    def version_lags(
        self, current_version: str, version_key: Callable[[str], Any] | None = None
    ) -> np.ndarray:
        """Per position, how many versions before `current_version` its token was sampled
        (`version_key(current) - version_key(label)`, `version_key` default `int`), for
        importance weights; -1 where no version is recorded (context positions)."""
        key = version_key or int
        lags = np.full(len(self), -1, dtype=np.int64)
        now = key(current_version)
        for span in self.weight_versions or ():
            lags[span["start"] : span["end"]] = now - key(span["version"])
        return lags

    def sampling_mask_rows(self) -> list[list[int]] | None:
        """The sampling mask as one list of allowed token ids per position."""
        if self.sampling_mask is None:
            return None
        ids, offsets = self.sampling_mask
        flat, bounds = ids.tolist(), offsets.tolist()
        return [flat[bounds[p] : bounds[p + 1]] for p in range(len(bounds) - 1)]


@dataclass(frozen=True)
class Source:
    """Which trajectory a row came from and its group keys."""

    trajectory_id: str
    instance_id: str
    prompt_index: int
    repetition_id: int


def sample_rows(source: Source, result: FinishResult) -> list[TrainingRow]:
    """Path rows: the finish's samples as they are (shared tokens trained once)."""
    return [_from_sample(source, s) for s in result.samples]


def _from_sample(source: Source, sample: Sample) -> TrainingRow:
    if sample.input_ids is None or sample.loss_mask is None or sample.logprobs is None:
        raise ValueError(_TEXT_MODE.format(id=source.trajectory_id))
    mask = sample.sampling_mask
    return TrainingRow(
        trajectory_id=source.trajectory_id,
        instance_id=source.instance_id,
        prompt_index=source.prompt_index,
        repetition_id=source.repetition_id,
        leaf=sample.leaf,
        targets=tuple(sample.targets),
        input_ids=np.asarray(sample.input_ids, dtype=np.int32),
        loss_mask=np.asarray(sample.loss_mask, dtype=np.int8),
        logprobs=np.asarray(sample.logprobs, dtype=np.float32),
        routed_experts=sample.routed_experts,
        sampling_mask=None if mask is None else rows_to_csr(mask),
        weight_versions=sample.weight_versions,
    )


_TEXT_MODE = (
    "trajectory {id} was captured in text mode and has no token ids to train on: run the "
    "capture server with mode='tokens'"
)


def read_record(result: FinishResult, record_dir: str | Path | None) -> LoadedRecord:
    """The trajectory's record, from `record_dir` or where the finish said it was written."""
    if record_dir is not None:
        directory = Path(record_dir)
    elif result.record is not None:
        directory = Path(result.record.path).parent
    else:
        raise ValueError(
            f"step and final rows read each trajectory's record, and {result.id} has none: "
            "run the capture server with a record_dir, or compose with mode='path'"
        )
    try:
        return load(directory, result.id)
    except RecordError as exc:
        raise ValueError(
            f"cannot read the record of {result.id} in {directory}: {exc}; pass "
            "compose(record_dir=...) where the records are"
        ) from exc


def graph_rows(source: Source, loaded: LoadedRecord, mode: str) -> list[TrainingRow]:
    """Step rows (each trained call: its prompt as context, its completion as the target)
    or the final row (the path to the latest call, every model node on it trained)."""
    graph = loaded.trajectory.graph
    if mode == "final":
        return [
            _from_built(source, build_sample(graph, row.path, row.targets), None)
            for row in rows_final(graph)
        ]
    recorded = loaded.trajectory.samples
    if isinstance(recorded, dict):
        targets = sorted(
            {t for row in rows_from_samples_field(graph, recorded) for t in row.targets}
        )
    else:
        targets = [node.id for node in graph if node.is_model]
    rows = []
    for target in targets:
        calls = graph[target].calls
        finish_reason = calls[-1].get("finish_reason") if calls else None
        built = build_sample(graph, graph.path_to(target), [target])
        rows.append(_from_built(source, built, finish_reason))
    return rows


def _from_built(source: Source, built: BuiltSample, finish_reason: str | None) -> TrainingRow:
    if built.input_ids is None or built.loss_mask is None or built.logprobs is None:
        raise ValueError(_TEXT_MODE.format(id=source.trajectory_id))
    return TrainingRow(
        trajectory_id=source.trajectory_id,
        instance_id=source.instance_id,
        prompt_index=source.prompt_index,
        repetition_id=source.repetition_id,
        leaf=built.leaf,
        targets=tuple(built.targets),
        input_ids=built.input_ids,
        loss_mask=built.loss_mask,
        logprobs=built.logprobs.astype(np.float32),
        routed_experts=built.routed_experts,
        sampling_mask=built.sampling_mask,
        finish_reason=finish_reason,
        weight_versions=built.weight_versions,
    )


def cut(row: TrainingRow, length: int) -> None:
    """Keep the first `length` positions of every per-position array (in place)."""
    row.input_ids = row.input_ids[:length]
    row.loss_mask = row.loss_mask[:length]
    row.logprobs = row.logprobs[:length]
    if row.routed_experts is not None:
        row.routed_experts = row.routed_experts[:length]
    if row.sampling_mask is not None:
        ids, offsets = row.sampling_mask
        offsets = offsets[: length + 1]
        row.sampling_mask = (ids[: int(offsets[-1])], offsets)
    row.weight_versions = clip_spans(row.weight_versions, length)
    row.truncated = True

"""`skycap.load`: read a record back as a trajectory and the samples its finish returned."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skycap.arrays import csr_to_rows
from skycap.client import Sample
from skycap.record.reader import (
    RecordError,
    document_path,
    record_document,
    trajectory_from_document,
)
from skycap.record.remote import MirrorCache, is_url
from skycap.record.remote import storage_options as env_storage_options
from skycap.samples import (
    BUILTIN_RULES,
    BuiltSample,
    build_samples,
    resolve_rule,
    rows_for_finish,
    rows_from_samples_field,
)
from skycap.trajectory import Trajectory


def to_client_sample(sample: BuiltSample) -> Sample:
    """The client's Sample: `Sample.from_json(encode_sample(sample))` without the JSON trip."""
    if sample.input_ids is None:
        return Sample(
            leaf=sample.leaf,
            path=list(sample.path),
            messages=sample.messages,
            targets=list(sample.targets),
        )
    mask = sample.sampling_mask
    return Sample(
        leaf=sample.leaf,
        path=list(sample.path),
        messages=sample.messages,
        targets=list(sample.targets),
        input_ids=sample.input_ids.tolist(),
        loss_mask=sample.loss_mask.tolist(),
        logprobs=sample.logprobs.tolist(),
        routed_experts=sample.routed_experts,
        sampling_mask=None if mask is None else csr_to_rows(*mask),
        media=[],
        weight_versions=sample.weight_versions,
    )


class LoadedRecord:
    """A record read back: its trajectory (sidecars included), its document, and its samples."""

    def __init__(
        self, trajectory: Trajectory, document: dict[str, Any], source: Path | None = None
    ) -> None:
        self.trajectory = trajectory
        self.document = document
        self.source = source

    @property
    def id(self) -> str:
        return self.trajectory.id

    def samples(self, paths: str = "all") -> list[Sample]:
        """The samples a finish with this rule returned.

        When the record holds rows recorded under `paths`, they are rebuilt from those rows
        (a custom rule is never re-run); otherwise the rule runs now: `all`, `final`, or a
        `"pkg.module:function"` import path.
        """
        graph = self.trajectory.graph
        recorded = self.trajectory.samples
        if isinstance(recorded, dict) and recorded.get("paths") == paths:
            try:
                rows = rows_from_samples_field(graph, recorded)
            except ValueError as exc:  # a hostile or damaged record (issue 17)
                where = self.source or self.id
                raise RecordError(f"{where}: {exc}") from None
        elif paths in BUILTIN_RULES:
            rows = rows_for_finish(graph, paths, {})
        elif ":" in paths:
            rows = rows_for_finish(graph, paths, {paths: resolve_rule(paths)})
        else:
            recorded_name = recorded.get("paths") if isinstance(recorded, dict) else None
            raise ValueError(
                f"no path rule {paths!r} for {self.id}: this record's samples were recorded "
                f"with {recorded_name!r}; ask for that, 'all', 'final', or a "
                "'pkg.module:function' rule"
            )
        return [to_client_sample(s) for s in build_samples(graph, rows)]


def load(
    record_dir: str | Path, id: str, *, storage_options: Mapping[str, Any] | None = None
) -> LoadedRecord:
    """Read record `id` from `record_dir`; raises RecordError with a one-line reason.

    `record_dir` may be a mirror URL (`s3://bucket/run-7`): the record's document and the
    sidecars the mirror holds are fetched into the local cache first, with
    `storage_options` (default: `$SKYCAP_STORAGE_OPTIONS`) passed to fsspec.
    """
    if is_url(record_dir):
        options = storage_options if storage_options is not None else env_storage_options()
        record_dir = MirrorCache(str(record_dir), options).fetch_record(id)
    record_dir = Path(record_dir)
    document = record_document(record_dir, id)
    source = document_path(record_dir, id)
    return LoadedRecord(trajectory_from_document(record_dir, document), document, source)

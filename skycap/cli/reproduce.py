"""`skycap check --reproduce`: re-render each token-mode call of recorded trajectories with a
named tokenizer and template, and report the calls whose prompt tokens differ
(docs/tokens.md "Reproducing a record's prompts")."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def run_reproduce(args: argparse.Namespace, directory: Path, ids: list[str]) -> int:
    """Exit 0 when every call matches, 1 when a call differs, 2 when something is unreadable."""
    from skycap.cli.folders import Progress
    from skycap.record.reader import RecordError, load_trajectory
    from skycap.tokens.library_renderer import LibraryRenderer
    from skycap.tokens.renderer import RenderError
    from skycap.tokens.reproduce import digest_drift, reproduce

    try:
        name = args.renderer or _recorded_renderer(directory, ids)
        renderer = LibraryRenderer(args.tokenizer, renderer_name=name)
    except RenderError as exc:
        print(f"skycap check --reproduce: {exc}", file=sys.stderr)
        return 2
    unreadable = differing = trajectories_differing = 0
    lines: list[str] = []
    with Progress("skycap check --reproduce", len(ids)) as progress:
        for trajectory_id in ids:
            progress.step()
            try:
                trajectory = load_trajectory(directory, trajectory_id)
            except (RecordError, OSError, ValueError) as exc:
                unreadable += 1
                lines.append(_line(args, {"id": trajectory_id, "error": str(exc)}))
                continue
            checks = reproduce(trajectory, renderer)
            drift = digest_drift(trajectory, renderer)
            bad = [c for c in checks if not c.matches]
            differing += len(bad)
            trajectories_differing += bool(bad)
            report = {
                "id": trajectory_id,
                "calls": len(checks),
                "differ": [c.describe() for c in bad],
                "digests_differ": drift,
            }
            lines.append(_line(args, report))
    summary = (
        f"{len(ids) - unreadable - trajectories_differing} of {len(ids)} trajectories "
        f"reproduce with {args.tokenizer}; {differing} call(s) differ"
        + (f"; {unreadable} unreadable" if unreadable else "")
    )
    print("\n".join(lines + ([] if args.json else [summary])))
    if unreadable:
        return 2
    return 1 if differing else 0


def _recorded_renderer(directory: Path, ids: list[str]) -> str | None:
    """The renderer the first readable record names in its provenance, or None (then the
    tokenizer's own, as token mode infers it)."""
    from skycap.record.reader import RecordError, document_path, read_document

    for trajectory_id in ids:
        try:
            provenance = read_document(document_path(directory, trajectory_id)).get("provenance")
        except (RecordError, OSError, ValueError):
            continue
        if isinstance(provenance, dict) and isinstance(provenance.get("renderer"), str):
            return provenance["renderer"]
    return None


def _line(args: argparse.Namespace, report: dict[str, Any]) -> str:
    """One trajectory's report: a JSON line, or its text lines."""
    if args.json:
        return json.dumps(report)
    if "error" in report:
        return f"{report['id']}  unreadable: {report['error']}"
    drift = report["digests_differ"]
    said = (
        f" (the record's provenance already differs: {', '.join(drift)})"
        if drift
        else " (the recorded digests match)"
        if report["differ"]
        else ""
    )
    if not report["calls"]:
        return f"{report['id']}  no token-mode calls to re-render"
    if not report["differ"]:
        return f"{report['id']}  {report['calls']} call(s) reproduce{said}"
    head = f"{report['id']}  {len(report['differ'])} of {report['calls']} call(s) differ{said}"
    return "\n".join([head, *(f"  {line}" for line in report["differ"])])

"""`skycap check`: whether each recorded trajectory is linear, and why it forks (graph.md §6)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skycap.linearity import Linearity

HELP = "Report whether recorded trajectories are linear, and why each fork happened."


def configure(parser: argparse.ArgumentParser) -> None:
    from skycap.cli.sources import add_storage_options

    parser.add_argument(
        "record_dir", metavar="RECORD_DIR", help="a record directory or a mirror URL (s3://...)"
    )
    parser.add_argument(
        "ids",
        metavar="TRAJECTORY_ID",
        nargs="*",
        default=[],  # without it argparse calls the optional ids "required" in its errors
        help="trajectories to check (default: all)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per trajectory (id, status, paths, causes, forks) per line "
        "(default: text)",
    )
    parser.add_argument(
        "--forks-only",
        action="store_true",
        help="list only trajectories that fork or cannot be read (default: all)",
    )
    parser.add_argument(
        "--reproduce",
        action="store_true",
        help="re-render each token-mode call with --tokenizer and report the calls whose "
        "prompt tokens differ from the recorded ones (exit 1 when any differ; default: "
        "report forks instead)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="NAME",
        help="with --reproduce: the tokenizer (hub name or folder) to re-render with "
        "(no default: --reproduce needs it)",
    )
    parser.add_argument(
        "--renderer",
        metavar="NAME",
        help="with --reproduce: the renderer name (default: the one the records name, else "
        "the one the tokenizer calls for)",
    )
    add_storage_options(parser)
    parser.set_defaults(check_parser=parser)


#: From this many trajectories on, the summary line also comes first, before the list.
SUMMARY_FIRST = 20


def _usage_error(args: argparse.Namespace, message: str) -> int:
    """An argument-parser error (usage + message on stderr) that returns instead of exiting."""
    parser: argparse.ArgumentParser = args.check_parser
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2


def _selected_ids(args: argparse.Namespace, record_dir: Path) -> list[str] | str:
    """The ids to check, or a usage-error message."""
    from skycap.record.reader import record_ids

    present = record_ids(record_dir)
    if not args.ids:
        return present or f"no trajectories in {args.record_dir}"
    wanted = list(dict.fromkeys(args.ids))
    # Membership in the listing also refuses ids that would escape the directory (`../tr_x`).
    known = set(present)
    missing = [i for i in wanted if i not in known]
    if missing:
        return f"no trajectory {', '.join(missing)} in {args.record_dir}"
    return wanted


def run(args: argparse.Namespace) -> int:
    from skycap.cli.folders import Progress
    from skycap.cli.sources import SourceError, record_dir
    from skycap.linearity import MalformedDocument, analyse, summary_line
    from skycap.record.reader import RecordError, document_path, read_document

    try:
        directory = record_dir(args.record_dir, args, sidecars=False)
    except SourceError as exc:
        return _usage_error(args, str(exc))
    try:
        ids = _selected_ids(args, directory)
    except OSError as exc:
        return _usage_error(args, f"cannot list {args.record_dir}: {exc.strerror or exc}")
    if isinstance(ids, str):
        return _usage_error(args, ids)
    if args.reproduce != (args.tokenizer is not None) or (args.renderer and not args.reproduce):
        return _usage_error(args, "--reproduce and --tokenizer NAME go together (--renderer too)")
    if args.reproduce:
        from skycap.cli.reproduce import run_reproduce

        return run_reproduce(args, directory, ids)

    reports: list[Linearity] = []
    unreadable: dict[str, str] = {}
    with Progress("skycap check", len(ids)) as progress:
        for trajectory_id in ids:
            progress.step()
            try:
                report = analyse(read_document(document_path(directory, trajectory_id)))
            except (RecordError, MalformedDocument) as exc:
                unreadable[trajectory_id] = str(exc)
            except (OSError, ValueError, TypeError) as exc:
                unreadable[trajectory_id] = f"{type(exc).__name__}: {exc}"
            else:
                report.id = trajectory_id
                reports.append(report)
    by_id = {r.id: r for r in reports}
    shown = [i for i in ids if not args.forks_only or i in unreadable or not by_id[i].linear]
    summary = summary_line(reports, len(unreadable))
    if args.json:
        for trajectory_id in shown:
            if trajectory_id in unreadable:
                line = {"id": trajectory_id, "error": unreadable[trajectory_id]}
            else:
                line = as_json(by_id[trajectory_id])
            print(json.dumps(line))
    else:
        if len(ids) >= SUMMARY_FIRST:
            print(summary)
        for trajectory_id in shown:
            if trajectory_id in unreadable:
                print(f"{trajectory_id}  unreadable: {unreadable[trajectory_id]}")
            else:
                print("\n".join(by_id[trajectory_id].lines()))
        print(summary)
    if unreadable:
        return 2
    return 0 if all(r.linear for r in reports) else 1


def as_json(report: Linearity) -> dict[str, Any]:
    """One trajectory of `--json`: its shape, its fork causes counted, and each fork."""
    return {
        "id": report.id,
        "status": report.status,
        "paths": report.paths,
        "linear": report.linear,
        "causes": dict(Counter(fork.cause for fork in report.forks)),
        "forks": [
            {"node": f.node, "parent": f.parent, "vs": f.vs, "cause": f.cause, "detail": f.detail}
            for f in report.forks
        ],
        "unbridged_calls": report.unbridged_calls,
    }

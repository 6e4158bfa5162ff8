"""`skycap check`: whether each recorded trajectory is linear, and why it forks (graph.md §12)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    add_storage_options(parser)
    parser.set_defaults(check_parser=parser)


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

    reports = []
    unreadable = 0
    for trajectory_id in ids:
        try:
            report = analyse(read_document(document_path(directory, trajectory_id)))
        except RecordError as exc:
            reason = str(exc)
        except MalformedDocument as exc:
            reason = str(exc)
        except (OSError, ValueError, TypeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            report.id = trajectory_id
            reports.append(report)
            print("\n".join(report.lines()))
            continue
        unreadable += 1
        print(f"{trajectory_id}  unreadable: {reason}")
    print(summary_line(reports, unreadable))
    if unreadable:
        return 2
    return 0 if all(r.linear for r in reports) else 1

"""`skycap validate`: check record directories against the viewer.md §7 rules, for CI."""

from __future__ import annotations

import argparse
import sys

HELP = "Check record directories against the record rules (exit 0 clean, 1 problems, 2 usage)."


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--limit {text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"--limit {value} is negative; pass 0 or more")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    from skycap.cli.sources import add_storage_options

    parser.add_argument(
        "dirs", nargs="+", metavar="DIR", help="record directories or mirror URLs to check"
    )
    add_storage_options(parser)
    parser.add_argument(
        "--documents-only",
        action="store_true",
        help="check documents only, not the sidecar files they list (the fast pass)",
    )
    parser.add_argument(
        "--limit",
        type=_limit,
        default=20,
        metavar="N",
        help="print at most N problem lines per directory (default 20)",
    )


def run(args: argparse.Namespace) -> int:
    from skycap.cli.sources import SourceError, record_dir
    from skycap.viewer.validate import check_directory

    local = []
    for directory in args.dirs:
        try:
            local.append(record_dir(directory, args, sidecars=not args.documents_only))
        except SourceError as exc:
            print(f"skycap validate: error: {exc}", file=sys.stderr)
            return 2
    bad = 0
    for directory, path in zip(args.dirs, local, strict=True):
        report = check_directory(path, sidecars=not args.documents_only, limit=args.limit)
        report.directory = directory
        for line in report.lines + report.footer():
            print(line)
        bad += report.bad
    return 1 if bad else 0

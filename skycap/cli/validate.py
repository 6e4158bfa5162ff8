"""`skycap validate`: check record directories against the record rules, for CI.

The rules are listed in docs/viewer.md "skycap validate"."""

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
        "dirs",
        nargs="+",
        metavar="DIR",
        help="record directories, folders of them (one per run, two levels down), or mirror "
        "URLs to check",
    )
    add_storage_options(parser)
    parser.add_argument(
        "--documents-only",
        action="store_true",
        help="check documents only, not the sidecar files they list (the fast pass; default "
        "off: every file is checked)",
    )
    parser.add_argument(
        "--limit",
        type=_limit,
        default=20,
        metavar="N",
        help="print at most N problem lines per directory (default 20)",
    )


def run(args: argparse.Namespace) -> int:
    from skycap.cli.folders import Progress, record_folders
    from skycap.cli.sources import SourceError, record_dir
    from skycap.viewer.validate import check_directory, document_ids

    local = []
    for directory in args.dirs:
        try:
            local.append(record_dir(directory, args, sidecars=not args.documents_only))
        except SourceError as exc:
            print(f"skycap validate: error: {exc}", file=sys.stderr)
            return 2
    folders = record_folders(list(zip(args.dirs, local, strict=True)))
    if isinstance(folders, str):
        print(f"skycap validate: error: {folders}", file=sys.stderr)
        return 2
    labels = {path: d for d, path in zip(args.dirs, local, strict=True)}
    bad = 0
    for folder in folders:
        ids = document_ids(folder)
        with Progress(f"skycap validate {folder}", len(ids)) as progress:
            report = check_directory(
                folder,
                sidecars=not args.documents_only,
                limit=args.limit,
                ids=ids,
                on_document=progress.step,
            )
        report.directory = labels.get(folder, str(folder))  # a mirror URL is named as given
        for line in report.lines + report.footer():
            print(line)
        bad += report.bad
    return 1 if bad else 0

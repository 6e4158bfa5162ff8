"""`skycap view`: serve a local, read-only web viewer over record directories (viewer.md)."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

HELP = "Browse record directories in a local, read-only web viewer."


def configure(parser: argparse.ArgumentParser) -> None:
    from skycap.cli.sources import add_storage_options

    parser.add_argument(
        "dirs",
        nargs="+",
        metavar="DIR",
        help="a record directory, a folder whose children or grandchildren are ones, or a "
        "mirror URL (s3://bucket/prefix)",
    )
    parser.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; anything wider exposes your records)",
    )
    parser.add_argument(
        "--group-by",
        default="step,instance_id",
        metavar="K1,K2",
        help="keys (meta, then annotations) that make a group (default step,instance_id)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="print nothing while serving (default off: print the URL)",
    )
    parser.add_argument(
        "--refresh",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how often a mirror URL is listed again for new and changed records (default 30)",
    )
    add_storage_options(parser)


def run(args: argparse.Namespace) -> int:
    from skycap.viewer.groups import QueryError, parse_group_by
    from skycap.viewer.server import make_server

    if not 0 <= args.port <= 65535:
        print(f"skycap view: error: --port must be 0-65535, got {args.port}", file=sys.stderr)
        return 2
    if not args.refresh > 0:
        print(f"skycap view: error: --refresh must be > 0, got {args.refresh}", file=sys.stderr)
        return 2
    from skycap.record.remote import is_url

    dirs = [Path(d) for d in args.dirs if not is_url(d)]
    for directory in dirs:
        if not directory.is_dir():
            print(f"skycap view: error: {directory} is not a directory", file=sys.stderr)
            return 2
    try:
        mirrors = _mirrors([d for d in args.dirs if is_url(d)], args)
    except ValueError as exc:
        print(f"skycap view: error: {exc}", file=sys.stderr)
        return 2
    try:
        group_by = parse_group_by(args.group_by)
    except QueryError:
        print(
            f"skycap view: error: --group-by {args.group_by!r} names no key; "
            "pass e.g. --group-by step,instance_id",
            file=sys.stderr,
        )
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"skycap view: warning: binding {args.host}; anyone who can reach it can read "
            "these records",
            file=sys.stderr,
        )
    try:
        server = make_server(
            dirs,
            host=args.host,
            port=args.port,
            group_by=group_by,
            mirrors=mirrors,
            mirror_interval=args.refresh,
        )
    except OSError as exc:
        # A name that does not resolve is a bad --host; anything else is about the port.
        fix = "pass another --host" if isinstance(exc, socket.gaierror) else "pass another --port"
        print(
            f"skycap view: error: cannot listen on {args.host}:{args.port}: "
            f"{exc.strerror or exc}; {fix}",
            file=sys.stderr,
        )
        return 1
    if not args.quiet:
        runs = server.viewer.index.runs
        records = sum(len(run.summaries) for run in runs.values())
        print(
            f"skycap view: {len(runs)} run(s), {records} record(s) at {server.url}  (Ctrl-C stops)",
            flush=True,
        )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _mirrors(urls: list[str], args: argparse.Namespace) -> list:
    """A cache per mirror URL (nothing is fetched yet); ValueError naming what is wrong."""
    if not urls:
        return []
    from skycap.record.remote import MirrorCache, storage_options

    options = storage_options(args.storage_options)
    try:
        return [MirrorCache(url, options) for url in urls]
    except (ImportError, TypeError) as exc:
        raise ValueError(str(exc)) from None

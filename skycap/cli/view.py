"""`skycap view`: serve a local, read-only web viewer over record directories (viewer.md)."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

HELP = "Browse record directories in a local, read-only web viewer."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dirs",
        nargs="+",
        metavar="DIR",
        help="a record directory, or a folder whose children or grandchildren are ones",
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


def run(args: argparse.Namespace) -> int:
    from skycap.viewer.groups import QueryError, parse_group_by
    from skycap.viewer.server import make_server

    if not 0 <= args.port <= 65535:
        print(f"skycap view: error: --port must be 0-65535, got {args.port}", file=sys.stderr)
        return 2
    for directory in args.dirs:
        if not Path(directory).is_dir():
            print(f"skycap view: error: {directory} is not a directory", file=sys.stderr)
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
            [Path(d) for d in args.dirs], host=args.host, port=args.port, group_by=group_by
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

"""`skycap top URL...`: a live terminal dashboard over one or more capture servers."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator

HELP = "live dashboard of capture servers: modes, rates, failures and live trajectories"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("urls", nargs="+", metavar="URL", help="capture server base URL")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    parser.add_argument(
        "--once",
        action="store_true",
        help="print one snapshot and exit (status 1 if any server is down)",
    )
    parser.add_argument(
        "--control-token-env",
        metavar="NAME",
        help="environment variable holding the servers' control token (default: "
        "SKYCAP_CONTROL_TOKEN, else the file skycap serve wrote for each port on this machine)",
    )
    parser.add_argument(
        "--sort",
        default="age",
        choices=["age", "calls", "nodes", "paths", "unbridged", "failures", "latency"],
        help="initial sort column (keys a/c/n/p/u/f/l change it live)",
    )


@contextlib.contextmanager
def _cbreak() -> Iterator[bool]:
    """Single-key input without echo when stdin is a terminal; yields whether keys work."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _read_key(timeout: float) -> str | None:
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return os.read(sys.stdin.fileno(), 1).decode(errors="ignore") if ready else None


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print(f"skycap top: --interval must be positive, got {args.interval}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.live import Live

    from skycap.dashboard import SORT_KEYS, Poller, render

    token = None
    if args.control_token_env:
        token = os.environ.get(args.control_token_env)
        if not token:
            print(
                f"skycap top: --control-token-env {args.control_token_env}: the variable is "
                "not set or empty",
                file=sys.stderr,
            )
            return 2
    sort = next(k for k, (label, _) in SORT_KEYS.items() if label == args.sort)
    poller = Poller(args.urls, control_token=token)
    # Scripts read `--once` from a pipe: give them whole rows instead of 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        if args.once:
            poller.poll()
            console.print(render(poller.servers, sort, footer=False))
            # Scripts use --once as a health check: any server down is a failure.
            return 0 if all(server.up for server in poller.servers) else 1
        with _cbreak() as keys, Live(console=console, screen=False, auto_refresh=False) as live:
            while True:
                poller.poll()
                live.update(render(poller.servers, sort), refresh=True)
                deadline = time.monotonic() + args.interval
                while (left := deadline - time.monotonic()) > 0:
                    key = _read_key(left) if keys else time.sleep(left)
                    if key == "q":
                        return 0
                    if key in SORT_KEYS:
                        sort = key
                        live.update(render(poller.servers, sort), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        poller.close()

"""`skycap top URL...`: a live terminal dashboard over one or more capture servers."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator

HELP = "live dashboard of capture servers: totals, rates, failures, live and ended trajectories"
SORTS = ("age", "idle", "calls", "nodes", "paths", "unbridged", "failures", "latency")

# Terminal input: escape sequences of the keys `skycap top` uses, longest first.
_SEQUENCES = {
    b"\x1b[A": "up",
    b"\x1bOA": "up",
    b"\x1b[B": "down",
    b"\x1bOB": "down",
    b"\x1b[C": "right",
    b"\x1bOC": "right",
    b"\x1b[D": "left",
    b"\x1bOD": "left",
    b"\x1b[5~": "pgup",
    b"\x1b[6~": "pgdn",
    b"\x1b[H": "home",
    b"\x1bOH": "home",
    b"\x1b[1~": "home",
    b"\x1b[F": "end",
    b"\x1bOF": "end",
    b"\x1b[4~": "end",
}
_SINGLE = {b"\r": "enter", b"\n": "enter", b"\x7f": "backspace", b"\x08": "backspace"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("urls", nargs="+", metavar="URL", help="capture server base URL")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between polls (default 1)"
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="print one snapshot of every live trajectory and exit (status 1 if any server "
        "is down; default: a live view)",
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
        choices=SORTS,
        help="initial sort of live trajectories (default age; keys change it live, ? lists them)",
    )
    parser.add_argument(
        "--filter",
        default="",
        metavar="WORDS",
        help="initial filter, e.g. 'task:alpha step:3 status:failed' (default: none; / edits it)",
    )


def parse_keys(data: bytes) -> list[str]:
    """Key names in a chunk of terminal input: `up`, `enter`, `esc`, or the character."""
    keys = []
    i = 0
    while i < len(data):
        for sequence, name in _SEQUENCES.items():
            if data.startswith(sequence, i):
                keys.append(name)
                i += len(sequence)
                break
        else:
            byte = data[i : i + 1]
            if byte == b"\x1b":
                keys.append("esc")
            elif byte in _SINGLE:
                keys.append(_SINGLE[byte])
            else:
                keys.append(byte.decode("latin-1"))
            i += 1
    return keys


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


def _read_keys(timeout: float) -> list[str]:
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return parse_keys(os.read(sys.stdin.fileno(), 64)) if ready else []


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print(f"skycap top: --interval must be positive, got {args.interval}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.live import Live

    from skycap.dashboard.entries import SORT_NAMES
    from skycap.dashboard.frames import render
    from skycap.dashboard.poll import Poller
    from skycap.dashboard.view import DETAIL, View

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
    view = View(sort=SORT_NAMES[args.sort], query=args.filter.strip())
    poller = Poller(args.urls, control_token=token)
    try:
        if args.once:
            poller.poll()
            # Scripts read `--once` from a pipe: give them whole rows instead of 80 columns.
            console = Console() if sys.stdout.isatty() else Console(width=200)
            console.print(render(poller.servers, view, console.width, None, keys=False))
            # Scripts use --once as a health check: any server down is a failure.
            return 0 if all(server.up for server in poller.servers) else 1
        console = Console()

        def frame() -> object:
            width, height = console.size
            return render(poller.servers, view, width, height)

        with (
            _cbreak() as keys,
            Live(console=console, screen=True, auto_refresh=False) as live,
        ):
            while True:
                poller.poll()
                if view.screen == DETAIL and view.detail is not None:
                    view.document = poller.document(view.detail.server, view.detail.id)
                live.update(frame(), refresh=True)
                deadline = time.monotonic() + args.interval
                while (left := deadline - time.monotonic()) > 0:
                    if not keys:
                        time.sleep(left)
                        break
                    pressed = _read_keys(left)
                    for key in pressed:
                        if not view.key(key):
                            return 0
                    if pressed:
                        if view.screen == DETAIL and view.document is None:
                            break  # fetch the trajectory now, not at the next poll
                        live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        poller.close()

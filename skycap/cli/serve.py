"""`skycap serve`: run a capture server in the foreground until SIGINT or SIGTERM.

Exit status: 0 after a clean shutdown, 1 when it cannot start, 3 when records could not
be written by the end of shutdown (their crash journals stay for the next start).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skycap.server.options import ServerOptions

HELP = "Run a capture server between an agent harness and an OpenAI-compatible server."
DEFAULT_RECORD_DIR = "records"
LOG_LEVELS = ("debug", "info", "warning", "error")
EXIT_RECORDS_LOST = 3


def configure(parser: argparse.ArgumentParser) -> None:
    from skycap.server.flags import add_arguments

    add_arguments(parser)
    # A server keeps its records unless told not to.
    parser.add_argument(
        "--no-record-dir",
        action="store_true",
        help="keep records in memory only, lost when the server stops (default off: ./records)",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="log level (default warning; info adds one access line per harness call)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="run N server processes, one event loop each, on ports --port..--port+N-1 "
        "(proxy ports likewise) with one control token (default 1)",
    )
    parser.set_defaults(serve_parser=parser)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal
    from urllib.parse import urlsplit

    from skycap.server.options import from_values

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    parser: argparse.ArgumentParser = args.serve_parser
    if args.no_record_dir and args.record_dir is not None:
        parser.error("--record-dir and --no-record-dir exclude each other; give one")
    values = vars(args)
    if not args.no_record_dir and args.record_dir is None:
        values = {**values, "record_dir": DEFAULT_RECORD_DIR}
    try:
        options = from_values(values)
    except (ValueError, TypeError, ImportError) as exc:
        parser.error(str(exc))
    log = logging.getLogger("skycap.server")
    if args.workers != 1:
        return _supervise(args, options, parser)

    def ready(url: str) -> None:
        settle_garbage_collector()
        port = urlsplit(url).port
        assert port is not None
        token_file = addon.publish_token(port, default=True)  # OSError: reported below
        upstream = options.upstream_url or "each call's original host"
        # The start line is news, not a warning: it goes to stderr whatever --log-level says.
        lines = [f"skycap {options.mode} mode listening on {url} (upstream {upstream})"]
        if options.record_mirror is not None:
            from skycap.record.mirror import redact

            lines.append(f"records mirrored to {redact(options.record_mirror)}")
        if addon.mode is not None and (described := addon.mode.describe()) is not None:
            lines.append(described)
        if token_file is not None:
            lines.append(f"control token in {token_file} (mode 0600)")
        if addon.proxy is not None:
            lines.append(
                f"HTTPS_PROXY listener on {options.host}:{addon.proxy.port} "
                f"(CA bundle {addon.proxy.ca.bundle})"
            )
        lines.append(records_line(options))
        print("\n".join(lines), file=sys.stderr, flush=True)
        if options.record_dir is None:
            log.warning(
                "--no-record-dir: records are kept in memory only and are lost when the "
                "server stops; fetch them with finish or GET /trajectories/{id} first"
            )
        if options.binds_beyond_loopback:
            log.warning(
                "listening on %s: other machines can reach the harness routes%s",
                options.host,
                "" if options.require_api_key else " without a trajectory key (--require-api-key)",
            )

    if options.mode == "tokens" and options.tokenizer is not None:
        from skycap.tokens.tokenizer_env import TokenizerUnavailable, tokenizer_source

        # A hub name may download: say what is happening. An unreachable hub is refused
        # here, before the server's imports, so the answer comes in seconds.
        print(
            f"skycap: loading tokenizer {options.tokenizer} (a hub name downloads unless it is "
            "cached; HF_HUB_OFFLINE=1 uses the cache only)",
            file=sys.stderr,
            flush=True,
        )
        try:
            tokenizer_source(options.tokenizer)
        except TokenizerUnavailable as exc:
            print(f"skycap serve: error: {exc}", file=sys.stderr)
            return 1

    from skycap.server.addon import SkycapAddon
    from skycap.server.runner import new_event_loop, serve, settle_garbage_collector

    try:
        addon = SkycapAddon(options)  # token mode loads its tokenizer here
    except Exception as exc:  # a bad tokenizer or engine setting: say so, no traceback
        log.debug("start-up failed", exc_info=True)
        print(f"skycap serve: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await serve(options, ready=ready, stop_event=stop, addons=[addon])

    try:
        asyncio.run(main(), loop_factory=new_event_loop)
    except OSError as exc:
        print(f"skycap serve: error: {exc}", file=sys.stderr)
        return 1
    lost = addon.store.lost if addon.store is not None else []
    if addon.store is not None:
        print(shutdown_line(addon.store.open_at_shutdown, lost, options), file=sys.stderr)
    if lost:
        print(
            f"skycap serve: error: {len(lost)} records could not be written to "
            f"{options.record_dir}: {', '.join(lost)}",
            file=sys.stderr,
        )
        return EXIT_RECORDS_LOST
    return 0


def _supervise(
    args: argparse.Namespace, options: ServerOptions, parser: argparse.ArgumentParser
) -> int:
    """`--workers N`: check the flags once here, then run N ordinary servers."""
    from skycap.cli.workers import supervise

    if args.workers < 1:
        parser.error(f"--workers {args.workers}: give a number of servers >= 1")
    if options.port == 0 or options.proxy_port == 0:
        parser.error("--workers needs fixed ports: give --port (and --proxy-port) other than 0")
    n, ports = args.workers, range(options.port, options.port + args.workers)
    if ports[-1] > 65535 or (options.proxy_port or 0) + n - 1 > 65535:
        parser.error(f"--workers {n}: the ports run past 65535; give a lower --port/--proxy-port")
    if options.proxy_port is not None and set(ports) & set(
        range(options.proxy_port, options.proxy_port + n)
    ):
        parser.error(
            f"--workers {n} uses ports {ports[0]}..{ports[-1]} and proxy ports "
            f"{options.proxy_port}..{options.proxy_port + n - 1}, which overlap; move "
            "--proxy-port out of that range"
        )
    argv: list[str] = args.argv
    return supervise(
        argv[argv.index("serve") + 1 :],
        workers=args.workers,
        host=options.host,
        port=options.port,
        proxy_port=options.proxy_port,
        control_token_given=args.control_token_env is not None,
        control_token_off=bool(args.no_control_token),
        record_dir=options.record_dir,
    )


def records_line(options: Any) -> str:
    """Where records go and when idle trajectories end, for the start line."""
    if options.record_dir is None:
        return "records: memory only (--no-record-dir); idle trajectories never expire"
    return (
        f"records: {options.record_dir}; a trajectory idle for {options.ttl:g} s is ended "
        "as abandoned and written (--ttl)"
    )


def shutdown_line(still_open: list[str], lost: list[str], options: Any) -> str:
    """What a stop did with the trajectories no finish had ended, so none go unnoticed."""
    written = [i for i in still_open if i not in lost]
    if not still_open:
        return "skycap serve: stopped; no trajectory was open"
    if options.record_dir is None:
        return (
            f"skycap serve: stopped; {len(still_open)} open trajectories dropped "
            "(--no-record-dir writes nothing)"
        )
    shown = ", ".join(written[:5]) + (", ..." if len(written) > 5 else "")
    count = f"{len(written)} open {'trajectory' if len(written) == 1 else 'trajectories'}"
    return f"skycap serve: stopped; wrote {count} (status open) to {options.record_dir}" + (
        f": {shown}" if written else ""
    )

"""`skycap serve`: run a capture server in the foreground until SIGINT or SIGTERM.

Exit status: 0 after a clean shutdown, 1 when it cannot start, 3 when records could not
be written by the end of shutdown (D-44; their crash journals stay for the next start).
"""

from __future__ import annotations

import argparse
import sys

HELP = "Run a capture server between an agent harness and an OpenAI-compatible server."
LOG_LEVELS = ("debug", "info", "warning", "error")
EXIT_RECORDS_LOST = 3


def configure(parser: argparse.ArgumentParser) -> None:
    from skycap.server.options import add_arguments

    add_arguments(parser)
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="log level (default warning; info adds one access line per harness call)",
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
    try:
        options = from_values(vars(args))
    except (ValueError, TypeError, ImportError) as exc:
        parser.error(str(exc))
    log = logging.getLogger("skycap.server")

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
        if addon.backend is not None:
            lines.append(
                f"token mode: {addon.backend.served.describe()}; logprobs_mode "
                f"{options.logprobs_mode} (vLLM's --logprobs-mode must match: its default is "
                "raw_logprobs)"
            )
        if token_file is not None:
            lines.append(f"control token in {token_file} (mode 0600)")
        if addon.proxy is not None:
            lines.append(
                f"HTTPS_PROXY listener on {options.host}:{addon.proxy.port} "
                f"(CA bundle {addon.proxy.ca.bundle})"
            )
        print("\n".join(lines), file=sys.stderr, flush=True)
        if options.binds_beyond_loopback:
            log.warning(
                "listening on %s: other machines can reach the harness routes%s (D-6)",
                options.host,
                "" if options.require_api_key else " without a trajectory key (--require-api-key)",
            )

    from skycap.server.addon import SkycapAddon
    from skycap.server.runner import serve, settle_garbage_collector

    if options.mode == "tokens" and options.tokenizer is not None:
        # A hub name may download (or, offline, retry for minutes): say what is happening.
        print(
            f"skycap: loading tokenizer {options.tokenizer} (a hub name downloads unless it is "
            "cached; HF_HUB_OFFLINE=1 uses the cache only)",
            file=sys.stderr,
            flush=True,
        )
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
        asyncio.run(main())
    except OSError as exc:
        print(f"skycap serve: error: {exc}", file=sys.stderr)
        return 1
    lost = addon.store.lost if addon.store is not None else []
    if lost:
        print(
            f"skycap serve: error: {len(lost)} records could not be written to "
            f"{options.record_dir}: {', '.join(lost)}",
            file=sys.stderr,
        )
        return EXIT_RECORDS_LOST
    return 0

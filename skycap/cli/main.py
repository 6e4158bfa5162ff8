"""The `skycap` entry point: dispatches to one module per subcommand, imported lazily.

Each subcommand module exposes `HELP` (one line), `configure(parser)` and `run(args) -> int`,
and imports heavy dependencies (mitmproxy, transformers) inside `run`, so that `skycap check`
starts fast and never loads mitmproxy.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from importlib.metadata import version

SUBCOMMANDS = {
    "demo": "skycap.cli.demo",
    "serve": "skycap.cli.serve",
    "check": "skycap.cli.check",
    "summary": "skycap.cli.summary",
    "validate": "skycap.cli.validate",
    "view": "skycap.cli.view",
    "top": "skycap.cli.top",
    "ca": "skycap.cli.ca",
}


def _available() -> dict[str, str]:
    """Subcommands whose module exists in this build."""
    return {
        name: module
        for name, module in SUBCOMMANDS.items()
        if importlib.util.find_spec(module) is not None
    }


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's, so errors show the right usage."""
    parser = argparse.ArgumentParser(
        prog="skycap",
        description="Capture what an LLM policy saw and sampled while an agent harness runs.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"skycap {version('skycap')}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands = {}
    for name, module_name in _available().items():
        module = importlib.import_module(module_name)
        commands[name] = subparsers.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(commands[name])
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # transformers announces at import that PyTorch is missing, which token mode never needs.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser, commands = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        (commands.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    args.argv = argv  # a supervisor (`serve --workers`) re-runs its own command line
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        return module.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`skycap check DIR | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

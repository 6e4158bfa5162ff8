"""`skycap ca`: print the CA bundle path a proxied harness trusts, creating the CA if needed."""

from __future__ import annotations

import argparse
import sys

HELP = "Print the path of the CA bundle (certifi's roots + skycap's CA) for SSL_CERT_FILE."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--confdir",
        metavar="DIR",
        help="directory of the CA (default $XDG_CONFIG_HOME/skycap or ~/.config/skycap); "
        "the same as `skycap serve --confdir`",
    )


def run(args: argparse.Namespace) -> int:
    from skycap.certs import ensure_ca

    try:
        ca = ensure_ca(args.confdir)
    except OSError as exc:
        print(f"skycap ca: error: {exc}", file=sys.stderr)
        return 1
    print(ca.bundle)
    return 0

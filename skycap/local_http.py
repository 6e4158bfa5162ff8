"""The stdlib threading HTTP server that skycap's own local servers (the record viewer, the
scripted engine) build on: a client that resets its connection has left, it has not failed.

Without this, socketserver prints a traceback for every keep-alive connection a client
closes with a reset (a pooled client at exit, a browser tab), onto the stderr a user reads.
"""

from __future__ import annotations

import sys
from http.server import ThreadingHTTPServer
from typing import Any


class LocalHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer with daemon handler threads, quiet about clients that left."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

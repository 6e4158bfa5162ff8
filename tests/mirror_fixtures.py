"""A real S3 API on loopback (moto in server mode) and a fault proxy in front of it.

moto cannot fail on demand, so the mirror's fault tests point s3fs at `FaultProxy`, a
small HTTP relay that forwards every request to moto unless told to reset connections,
hold requests until released, or answer with S3 error documents.
"""

from __future__ import annotations

import http.client
import itertools
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

KEY = SECRET = "testing"
REGION = "us-east-1"
HOLD_LIMIT = 30.0  # a held request is let go after this long even if a test forgot it
_buckets = itertools.count()


def s3_options(endpoint: str) -> dict[str, Any]:
    """storage_options for s3fs against `endpoint`, with the clients' own retries off, so
    the mirror's `attempts` and `backoff` are what is tested."""
    return {
        "endpoint_url": endpoint,
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"region_name": REGION},
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    }


@dataclass
class S3:
    """The moto server: its endpoint, and a boto3 client to make buckets and read objects."""

    endpoint: str
    client: Any

    def bucket(self) -> str:
        name = f"skycap-test-{next(_buckets)}"
        self.client.create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        listed = self.client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        return {
            item["Key"].rpartition("/")[2]: self.client.get_object(Bucket=bucket, Key=item["Key"])[
                "Body"
            ].read()
            for item in listed
        }


@pytest.fixture(scope="session")
def s3() -> Iterator[S3]:
    """moto's S3 on a free loopback port, started once per test session."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name=REGION,
    )
    yield S3(endpoint, client)
    server.stop()


ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    403: ("AccessDenied", "Access Denied"),
}


@dataclass
class FaultProxy:
    """An HTTP relay to `target`; faults apply to object PUTs (the mirror's copies).

    `reset`: drop the connection without an answer (the store is down). `hold`: keep each
    PUT until `release()` (slow store). `fail`: answer the next `fail_count` PUTs with
    that status's S3 error document (then pass again).
    """

    target: str
    reset: bool = False
    hold: bool = False
    fail: int | None = None
    fail_count: int = 0
    puts: int = 0
    held: int = 0
    released: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def release(self) -> None:
        self.hold = False
        self.released.set()

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.command == "PUT" and "/" in self.path.strip("/").partition("?")[0]:
                    if proxy._fault(self):
                        return
                host, port = proxy.target.rpartition("/")[2].split(":")
                upstream = http.client.HTTPConnection(host, int(port), timeout=30)
                upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
                reply = upstream.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for name, value in reply.getheaders():
                    if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def _fault(self, handler: BaseHTTPRequestHandler) -> bool:
        """Apply a fault to one PUT; True when it was answered (or dropped) here."""
        with self.lock:
            self.puts += 1
            failing = self.fail is not None and self.fail_count > 0
            if failing:
                self.fail_count -= 1
        if self.reset:
            handler.close_connection = True
            handler.connection.close()
            return True
        if self.hold:
            with self.lock:
                self.held += 1
            self.released.wait(HOLD_LIMIT)
        if failing:
            assert self.fail is not None
            code, message = ERRORS[self.fail]
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{message}</Message></Error>"
            ).encode()
            handler.send_response(self.fail)
            handler.send_header("Content-Type", "application/xml")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            return True
        return False

    def stop(self) -> None:
        self.release()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def fault_proxy(s3: S3) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3.endpoint).start()
    yield proxy
    proxy.stop()

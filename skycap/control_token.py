"""The control credential: made at start, kept in a 0600 file, and found again by clients.

Control routes (`/trajectories...`, `/healthz` details) take `Authorization: Bearer <control
token>`; a harness only ever holds its own trajectory's key, so it cannot create, list,
read or finish trajectories (docs/security.md). A client that is given no token finds one
the way `find_control_token` says: a CaptureService running in the same process, then
`SKYCAP_CONTROL_TOKEN`, then the file `skycap serve` wrote for that port on this machine.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import ipaddress
import os
import secrets
import socket
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

from skycap.certs import default_confdir

ENV = "SKYCAP_CONTROL_TOKEN"
TOKEN_PREFIX = "skycap-control-"
MIN_LENGTH = 16
_FILE_PREFIX = "control-token-"

_lock = threading.Lock()
_in_process: dict[int, tuple[str, str]] = {}  # port -> (host, token) of running services


def new_control_token() -> str:
    """`skycap-control-` + URL-safe base64 of 32 random bytes (no padding)."""
    raw = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode("ascii").rstrip("=")
    return TOKEN_PREFIX + raw


def check_control_token(token: str, source: str) -> str:
    """A token given by the user, checked so a typo or an empty variable fails at start."""
    if len(token) < MIN_LENGTH or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(
            f"{source} must be at least {MIN_LENGTH} printable ASCII characters without "
            f"spaces, got {len(token)} characters; generate one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    return token


def default_token_file(port: int) -> Path:
    """Where `skycap serve` on `port` writes its token: `<confdir>/control-token-<port>`."""
    return default_confdir() / f"{_FILE_PREFIX}{port}"


def write_token_file(path: Path, token: str) -> None:
    """Write `token` to `path` atomically, readable by this user only (0600 from the start).

    A missing parent directory is created 0700. Raises OSError naming the path.
    """
    path = Path(path).expanduser().absolute()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".control-token-")
    try:
        with os.fdopen(fd, "w") as handle:  # mkstemp opens 0600
            handle.write(token + "\n")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def read_token_file(path: Path) -> str | None:
    """The token a file holds, None when it is missing or unreadable."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return token or None


def remove_token_file(path: Path, token: str) -> None:
    """Remove `path` if it still holds `token` (another server may have rewritten it since)."""
    if read_token_file(path) == token:
        with contextlib.suppress(OSError):
            os.unlink(path)


def register(url: str, token: str) -> None:
    """A CaptureService of this process serves `url` with `token` (found by CapturePool)."""
    host, port = _host_port(url)
    with _lock:
        _in_process[port] = (host, token)


def unregister(url: str) -> None:
    with _lock:
        _in_process.pop(_host_port(url)[1], None)


def find_control_token(url: str) -> str | None:
    """The control token to send to the server at `url` when the caller gave none.

    In order: a CaptureService running in this process at that address; the
    `SKYCAP_CONTROL_TOKEN` variable; the file `skycap serve` wrote for that port, read only
    when the URL's host is this machine (a local secret is never sent elsewhere).
    """
    host, port = _host_port(url)
    with _lock:
        running = _in_process.get(port)
    if running is not None and (host == running[0] or is_this_machine(host)):
        return running[1]
    if token := os.environ.get(ENV):
        return token
    if is_this_machine(host):
        return read_token_file(default_token_file(port))
    return None


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return (parts.hostname or ""), port


@functools.lru_cache(maxsize=64)
def is_this_machine(host: str) -> bool:
    """Whether `host` names this machine: a loopback name or an address it could bind."""
    if host == "localhost":
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=6)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(_local_address(address) for address in addresses)


def _local_address(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))  # only an address of this machine can be bound
        except OSError:
            return False
    return True

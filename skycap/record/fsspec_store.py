"""Opening the fsspec store behind a mirror URL, and judging the errors its copies raise.

Shared by the mirror (in the server's process) and its copy process, which must agree on
what a retry may fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MISSING_EXTRA = (
    "the record mirror needs fsspec and the package of the URL's protocol: install "
    "skycap[remote] (in a checkout: uv sync --extra remote)"
)
ERROR_CHARS = 300
# OSErrors that a retry cannot fix (docs/mirror.md "Options"); every other OSError is transient.
PERMANENT = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)
PERMANENT += (FileExistsError,)
# Transport errors of the S3 and HTTP clients (botocore, aiohttp) that are not OSErrors;
# matched by class name so this module imports no client library.
TRANSIENT_NAMES = frozenset({"ConnectionError", "HTTPClientError", "ClientConnectionError"})


class CopyFailed(Exception):
    """A put that failed in the copy process, carried back as its text and whether a retry
    may help (the exception object itself may not survive pickling)."""

    def __init__(self, text: str, transient: bool) -> None:
        super().__init__(text)
        self.text = text
        self.transient = transient


def redact(url: str) -> str:
    """`url` without a password in its userinfo (`s3://key:secret@bucket` -> `s3://key@bucket`)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc}" if user else netloc))


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, root path inside it) for a mirror URL; fails fast and clearly.

    A missing fsspec, or a protocol whose package is not installed (gcsfs for gs://, ...),
    is an ImportError naming the `remote` extra; an unknown protocol is a ValueError.
    """
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise ImportError(f"{redact(url)}: {MISSING_EXTRA}") from None
    try:
        fs, root = url_to_fs(url, **dict(storage_options or {}))
    except ImportError as exc:
        raise ImportError(f"{redact(url)}: {one_line(exc)}; {MISSING_EXTRA}") from None
    except ValueError as exc:
        raise ValueError(f"{redact(url)} is not a usable fsspec URL: {one_line(exc)}") from None
    return fs, root.rstrip("/")


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:ERROR_CHARS]


def error_text(exc: BaseException) -> str:
    if isinstance(exc, CopyFailed):
        return exc.text
    return f"{type(exc).__name__}: {one_line(exc)}"


def transient(exc: BaseException) -> bool:
    """Whether a retry may fix `exc` (docs/mirror.md "Options"): connection errors, timeouts, and
    every OSError but permission denied, not found, is/not a directory, already exists."""
    if isinstance(exc, CopyFailed):  # judged in the copy process, where it was raised
        return exc.transient
    if isinstance(exc, PERMANENT):
        return False
    if isinstance(exc, OSError | TimeoutError):
        return True
    return any(cls.__name__ in TRANSIENT_NAMES for cls in type(exc).__mro__)

"""Per-trajectory API keys, the constant-time `Authorization` check of http.md §4, proxy Basic."""

from __future__ import annotations

import base64
import binascii
import hmac
import secrets
from collections.abc import Iterable

KEY_PREFIX = "sk-skycap-"
_BEARER = b"bearer"
_BASIC = b"basic"
_WHITESPACE = b" \t\r\n\x0b\x0c"


def new_api_key() -> str:
    """`sk-skycap-` + URL-safe base64 of 24 random bytes (32 characters, no padding)."""
    return KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(24)).decode("ascii")


def raw_header(fields: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header `name` (lowercase) among raw fields, as mitmproxy holds them.

    Keys are compared as bytes (http.md §4), so a value that is not text is still found.
    """
    for key, value in fields:
        if key.lower() == name:
            return value
    return None


def text_header(fields: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """`raw_header` as text, decoded as mitmproxy's `Headers.get` decodes it (UTF-8, a byte
    that is not kept as a surrogate); without `Headers.get`'s walk over every field."""
    value = raw_header(fields, name)
    return None if value is None else value.decode("utf-8", "surrogateescape")


def _split_scheme(header: bytes) -> tuple[bytes, bytes] | None:
    """(scheme lowercased, credentials stripped) of an auth header value, None without both."""
    value = header.strip(_WHITESPACE)
    cut = next((i for i, byte in enumerate(value) if byte in _WHITESPACE), -1)
    if cut < 0:
        return None
    return value[:cut].lower(), value[cut:].strip(_WHITESPACE)


def bearer_key(header: bytes) -> bytes | None:
    """The key of a `Bearer` header value, None when the value is not one.

    The scheme is matched case-insensitively and any whitespace may separate it from the key.
    """
    parts = _split_scheme(header)
    if parts is None or parts[0] != _BEARER:
        return None
    return parts[1]


def authorized(header: bytes | None, key: bytes) -> bool:
    """Whether an `Authorization` header value carries `key` as a bearer token.

    The header is compared as raw bytes (mitmproxy hands over undecoded header bytes), so
    a non-UTF-8 or non-ASCII value is simply a mismatch, never an error.
    """
    sent = bearer_key(header) if header else None
    return sent is not None and hmac.compare_digest(sent, key)


def key_matches(value: bytes | None, key: bytes) -> bool:
    """Whether a bare key header (`x-api-key`, as Anthropic SDKs send it) carries `key`."""
    return bool(value) and hmac.compare_digest(value.strip(_WHITESPACE), key)


def basic_credentials(header: bytes) -> tuple[bytes, bytes] | None:
    """(user, password) of a `Basic` header value (`Proxy-Authorization`), None if malformed.

    Both stay bytes: the caller compares the password in constant time with
    `hmac.compare_digest`, and a value that is not text is a mismatch, never an error.
    """
    parts = _split_scheme(header)
    if parts is None or parts[0] != _BASIC:
        return None
    try:
        decoded = base64.b64decode(parts[1], validate=True)
    except (binascii.Error, ValueError):
        return None
    user, colon, password = decoded.partition(b":")
    return (user, password) if colon else None

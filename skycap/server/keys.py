"""Per-trajectory API keys and the constant-time `Authorization` check of http.md §4."""

from __future__ import annotations

import base64
import hmac
import secrets

KEY_PREFIX = "sk-skycap-"
_BEARER = b"bearer"
_WHITESPACE = b" \t\r\n\x0b\x0c"


def new_api_key() -> str:
    """`sk-skycap-` + URL-safe base64 of 24 random bytes (32 characters, no padding)."""
    return KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(24)).decode("ascii")


def authorized(header: bytes | None, key: bytes) -> bool:
    """Whether an `Authorization` header value carries `key` as a bearer token.

    The header is compared as raw bytes (mitmproxy hands over undecoded header bytes), so
    a non-UTF-8 or non-ASCII value is simply a mismatch, never an error. The scheme is
    matched case-insensitively and any whitespace may separate it from the key.
    """
    if not header:
        return False
    value = header.strip(_WHITESPACE)
    cut = next((i for i, byte in enumerate(value) if byte in _WHITESPACE), -1)
    if cut < 0 or value[:cut].lower() != _BEARER:
        return False
    return hmac.compare_digest(value[cut:].strip(_WHITESPACE), key)

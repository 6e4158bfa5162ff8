"""mitmproxy's `Request` and `Response` from HTTP/1.1 heads, without its debug-mode type checks.

Unless Python runs with -O, mitmproxy checks the type of every field of each request and
response it builds (`MessageData.__post_init__`); on the base-URL path that was a sixth of
a text-mode call's CPU (docs/performance.md "Text mode"). Here the values come from
skycap's own parsing or code, of the right types by construction, so the objects are
built directly. They are ordinary mitmproxy objects afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from mitmproxy import http
from mitmproxy.net.http import status_codes

Fields = Iterable[tuple[bytes, bytes]]
JSON: Fields = ((b"content-type", b"application/json"),)
_SPACE_BYTES = frozenset(b" \t")
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def request_head(head: bytes) -> http.Request | None:
    """An origin-form HTTP/1.1 request head (`METHOD /path HTTP/1.1` and its headers, up to
    and including the blank line), or None for anything else: another version or target
    form, a folded header line, a malformed one."""
    lines = head.split(b"\r\n")[:-2]
    if not lines:
        return None
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        return None
    method, path, version = parts
    if version != b"HTTP/1.1" or not path.startswith(b"/") or not method:
        return None
    if not _TOKEN.issuperset(method):
        return None
    fields = _fields(lines[1:])
    if fields is None:
        return None
    request = http.Request.__new__(http.Request)
    request.data = _unchecked(
        http.RequestData,
        host="",
        port=0,
        method=method,
        scheme=b"http",
        authority=b"",
        path=path,
        http_version=version,
        headers=_headers(fields),
        content=None,
        trailers=None,
        timestamp_start=time.time(),
        timestamp_end=None,
    )
    return request


def response_head(head: bytes) -> http.Response:
    """An HTTP/1.x response head; raises ValueError naming what is malformed."""
    lines = head.split(b"\r\n")[:-2]
    if not lines:
        raise ValueError("empty response head")
    version, _, rest = lines[0].partition(b" ")
    status, _, reason = rest.partition(b" ")
    if not version.startswith(b"HTTP/1.") or not status.isdigit() or len(status) != 3:
        raise ValueError(f"bad response line: {lines[0][:100]!r}")
    fields = _fields(lines[1:])
    if fields is None:
        raise ValueError("bad response header line")
    return _response(version, int(status), reason, fields, None)


def asks_close(fields: Fields) -> bool:
    """Whether headers say `connection: close`."""
    for name, value in fields:  # a loop, not any(): read for every request and response
        if name.lower() == b"connection" and says_close(value):
            return True
    return False


def says_close(value: bytes) -> bool:
    """Whether one `connection` header value asks to close."""
    return value.lower().find(b"close") >= 0


def response_of(status: int, fields: Fields) -> http.Response:
    """A response head whose body is still to come."""
    reason = status_codes.RESPONSES.get(status, "").encode()
    return _response(b"HTTP/1.1", status, reason, fields, None)


def response(
    status: int, content: bytes, headers: Fields | http.Headers | dict[str, str]
) -> http.Response:
    """A complete HTTP/1.1 response with `content` and its content-length, as
    `http.Response.make(status, content, headers)` makes one."""
    if isinstance(headers, http.Headers):
        fields: Fields = headers.fields
    elif isinstance(headers, dict):
        fields = [(k.encode(), v.encode()) for k, v in headers.items()]
    else:
        fields = headers
    listed = [(k, v) for k, v in fields if k.lower() != b"content-length"]
    listed.append((b"content-length", b"%d" % len(content)))
    reason = status_codes.RESPONSES.get(status, "").encode()
    answer = _response(b"HTTP/1.1", status, reason, listed, content)
    answer.data.timestamp_end = answer.data.timestamp_start
    return answer


def _response(
    version: bytes, status: int, reason: bytes, fields: Fields, content: bytes | None
) -> http.Response:
    answer = http.Response.__new__(http.Response)
    answer.data = _unchecked(
        http.ResponseData,
        http_version=version,
        status_code=status,
        reason=reason,
        headers=_headers(fields),
        content=content,
        trailers=None,
        timestamp_start=time.time(),
        timestamp_end=None,
    )
    return answer


def _headers(fields: Fields) -> http.Headers:
    """`http.Headers(fields)` without its checks: every name and value here is bytes, from
    skycap's own parse or code."""
    headers = http.Headers.__new__(http.Headers)
    headers.fields = tuple(fields)
    return headers


def _unchecked[Data: (http.RequestData, http.ResponseData)](
    cls: type[Data], **values: object
) -> Data:
    """`cls(**values)` without its `__post_init__` (the type checks)."""
    data = cls.__new__(cls)
    data.__dict__.update(values)
    return data


def _fields(lines: list[bytes]) -> list[tuple[bytes, bytes]] | None:
    """The header lines as (name, value); None for a line without a name (as mitmproxy's
    own reader refuses) or a folded one, which starts with whitespace."""
    fields = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name[0] in _SPACE_BYTES or name[-1] in _SPACE_BYTES:
            return None
        fields.append((name, value.strip()))
    return fields

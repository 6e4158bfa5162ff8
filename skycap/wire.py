"""Strict JSON request-body parsing and the control-route error body, shared by every route.

Every body skycap parses goes through `parse_json_body`, which refuses what could not be
stored faithfully: invalid UTF-8, lone surrogates, integers beyond 64 bits and
nesting deeper than `MAX_DEPTH` (orjson reads 1,024 levels but writes only 254, so a
deeper value would be accepted and then never written). `check_depth` applies the same
limit to a value that did not come from a body.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

NOT_JSON = "request body is not JSON"

# orjson keeps integers in [-2**63, 2**64 - 1] and silently turns larger ones into floats,
# losing digits. Any such literal has at least 19 digits, so a body without a run of
# 19 digits needs no closer look. One C-speed translate serves both scans of a body:
# digits become "0" (for the digit runs), opening brackets "[" (counted for the depth
# check below), everything else a space.
_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
_MASK = bytes(48 if 48 <= b <= 57 else 91 if b in b"[{" else 32 for b in range(256))
_LONG_DIGIT_RUN = b"0" * 19


#: The deepest nesting of arrays and objects accepted anywhere; the body is level 1.
MAX_DEPTH = 128
# Below this size a body with at most MAX_DEPTH brackets needs no walk (a C-speed count).
_COUNT_ONLY = 1 << 16


class BodyError(ValueError):
    """A request body skycap refuses; `str(error)` is the one-line message sent back and
    `param`, when known, the request field at fault (OpenAI-shaped errors carry it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _BigInteger(Exception):
    def __init__(self, literal: str) -> None:
        self.literal = literal


def parse_json_body(raw: bytes, *, allow_empty: bool = False) -> Any:
    """Parse a request body strictly, so a body is never stored in a lossy form.

    With `allow_empty`, an empty or all-whitespace body returns None (control routes treat
    it as `{}`); otherwise it is an error like any other non-JSON body.
    """
    if allow_empty and not raw.strip():
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyError(_decode_problem(raw, exc)) from None
    masked = raw.translate(_MASK)
    # `find`, not `in`: `in` on bytes first tries its operand as an int, an exception each time.
    if masked.find(_LONG_DIGIT_RUN) >= 0:
        _reject_big_integers(raw)
    if len(raw) > _COUNT_ONLY or masked.count(b"[") > MAX_DEPTH:
        check_depth(value)
    return value


def check_depth(value: Any, what: str = "the request body", limit: int = MAX_DEPTH) -> None:
    """Raise BodyError when `value` nests arrays and objects deeper than `limit` levels.

    A dialect that builds values of its own (or reads them from elsewhere than a body)
    calls this; bodies read with `parse_json_body` are already checked.
    """
    if type(value) in (dict, list) and not _within(value, limit):
        raise BodyError(depth_message(what, limit))


def depth_message(what: str = "the request body", limit: int = MAX_DEPTH) -> str:
    return (
        f"{what} nests arrays and objects deeper than {limit} levels, the limit skycap "
        "accepts: flatten it, or send deep data as a JSON string"
    )


def _within(container: dict[str, Any] | list[Any], left: int) -> bool:
    """Whether `container` (one level) and what it holds fit in `left` levels."""
    if left <= 0:
        return False
    for child in container.values() if type(container) is dict else container:
        kind = type(child)
        if (kind is dict or kind is list) and not _within(child, left - 1):
            return False
    return True


def _decode_problem(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    detail = str(exc)
    if not raw.strip():
        return f"{NOT_JSON}: the body is empty; send a JSON object"
    if exc.msg.startswith("str is not valid UTF-8"):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            return (
                f"{NOT_JSON}: it is not valid UTF-8 (byte 0x{raw[bad.start]:02x} at offset "
                f"{bad.start}: {bad.reason}); send UTF-8 encoded JSON"
            )
    if "surrogate" in exc.msg:
        return (
            f"{NOT_JSON}: a string holds a lone UTF-16 surrogate escape ({detail}); "
            "strings must be valid Unicode"
        )
    if exc.msg.startswith("number is infinity"):
        _reject_big_integers(raw)
    if exc.msg.startswith(("depth limit exceeded", "Recursion limit reached")):
        return depth_message()
    return f"{NOT_JSON}: {detail}"


def _reject_big_integers(raw: bytes) -> None:
    """Find the first integer literal outside 64 bits with the stdlib parser (rare path)."""
    try:
        json.loads(raw, parse_int=_checked_int)
    except _BigInteger as big:
        literal = big.literal if len(big.literal) <= 40 else big.literal[:37] + "..."
        raise BodyError(
            f"{NOT_JSON}: integer {literal} is beyond 64 bits (allowed: {_INT_MIN} to "
            f"{_INT_MAX}); send it as a string"
        ) from None
    except (ValueError, RecursionError):
        return


def _checked_int(literal: str) -> int:
    if len(literal.lstrip("-")) > 20:
        raise _BigInteger(literal)
    value = int(literal)
    if not _INT_MIN <= value <= _INT_MAX:
        raise _BigInteger(literal)
    return value


def all_objects(values: list[Any]) -> bool:
    """Whether every value is a JSON object (a plain loop: cheaper than `all` over a
    generator, on paths taken for every call or streamed token)."""
    for value in values:
        if type(value) is not dict:
            return False
    return True


def json_type(value: Any) -> str:
    """How an error message names a JSON value's type ("an array", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def control_error(message: str, code: str | None = None) -> bytes:
    """The control-route error body of http.md §1: `{"error": message}`, plus `code` if given."""
    body: dict[str, str] = {"error": message}
    if code is not None:
        body["code"] = code
    return orjson.dumps(body)

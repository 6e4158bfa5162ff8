"""Parts of a call that skycap does not read, kept exactly as sent so their replay matches.

Text mode is a recorder, not a gate: an item, content part, block or tool of a type skycap
does not understand is forwarded unchanged and kept in the canonical message as an opaque
part holding the value as sent. The message hash covers the part like any other content,
so a harness that sends the same value again lands on the same node. Token mode cannot
render what it does not read, so a dialect that keeps an opaque part also names it in the
request's token refusal (`refusal` below) and token mode answers 400 before inference.
"""

from __future__ import annotations

from typing import Any

#: The canonical part type of a value skycap keeps without reading (docs/format.md).
OPAQUE = "opaque"
#: The role of a canonical message made of one opaque item that carried no role.
OPAQUE_ROLE = "opaque"


def opaque(dialect: str, value: Any) -> dict[str, Any]:
    """The canonical part for `value`, exactly as the harness sent it in `dialect`."""
    return {"type": OPAQUE, "dialect": dialect, "value": value}


def is_opaque(part: Any) -> bool:
    """Whether a canonical content part is one skycap kept without reading."""
    return isinstance(part, dict) and part.get("type") == OPAQUE and "value" in part


def opaque_message(dialect: str, value: Any, role: str | None = None) -> dict[str, Any]:
    """A canonical message made only of one opaque item (its own role, if it had one)."""
    return {"role": role or OPAQUE_ROLE, "content": [opaque(dialect, value)]}


def kind_of(value: Any) -> str:
    """How a refusal names an opaque value: its `type` field, or the JSON type it is."""
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        return value["type"]
    return type(value).__name__


def refusal(value: Any, path: str) -> str:
    """Token mode's 400 for an opaque value at `path` (a JSON path into the request body)."""
    return (
        f"{path} has type {kind_of(value)!r}, which token mode cannot render (skycap keeps it "
        "as sent in text mode only); remove it from the request, or capture this harness in "
        "text mode (--mode text)"
    )

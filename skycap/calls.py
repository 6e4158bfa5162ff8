"""The call record a model node keeps for each call that produced it, built here for both modes.

Text mode (skycap/server/textmode.py) and token mode (skycap/tokens/turn.py) measure
different things, but the record's fields and their order are one list: the call's
timing, model, sampling, usage, finish reason and dialect; what the mode measured; what
the dialect read to record; and the marks of this call (docs/format.md §4, "The document").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from skycap.dialects import Dialect, Request


def call_record(
    request: Request,
    dialect: Dialect,
    *,
    t_start: float,
    model: Any,
    sampling: Any,
    usage: Any,
    finish_reason: Any,
    measured: Mapping[str, Any] | None = None,
    marks: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The call record, ended now; the commit adds `tools` and `bridged`.

    `measured` are the fields only one mode knows (token mode's stop string, missing
    logprobs, the engine's finish reason); `marks` are those that apply to this call only
    (`reply_id_mark`, `harness_mark`, token mode's `omitted_tools`), in the order given.
    """
    return {
        "t_start": t_start,
        "t_end": time.time(),
        "model": model,
        "sampling": sampling,
        "usage": usage,
        "finish_reason": finish_reason,
        "dialect": dialect.name,
        **(measured or {}),
        **request.recorded,
        **(marks or {}),
    }


def reply_id_mark(dialect: Dialect, reply_id: Any) -> dict[str, Any]:
    """The reply's id under the dialect's key, for a dialect whose later calls may name it."""
    key = dialect.reply_id_key
    return {key: reply_id} if key is not None and isinstance(reply_id, str) else {}


def harness_mark(saw_end: bool) -> dict[str, Any]:
    """`harness_saw_end: false` for a call committed after its harness went away."""
    return {} if saw_end else {"harness_saw_end": False}

"""What a token-mode call answers: the Reply, and the refusals and failures that end a turn
before its commit, written in the caller's dialect (http.md §3.2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skycap.dialects import Dialect
from skycap.trajectory import Trajectory

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclass(frozen=True, slots=True)
class Reply:
    """A complete answer for the harness; `replayable`: SDK retries may reuse it (http.md §5).

    `call` is the committed call's record when the turn committed (what /healthz counts).
    """

    status: int
    headers: dict[str, str]
    body: bytes
    replayable: bool = False
    call: dict[str, Any] | None = None


class TurnFailed(Exception):
    """A turn that ends before the commit with this reply (refusal or engine failure)."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply


def error(
    dialect: Dialect,
    status: int,
    message: str,
    code: str | None = None,
    *,
    param: str | None = None,
) -> Reply:
    """A refusal or failure in the caller's dialect; `param` names the field at fault."""
    body = dialect.error(status, message, code, param)
    return Reply(status, {"content-type": "application/json"}, body)


def too_long(trajectory: Trajectory, dialect: Dialect, message: str) -> TurnFailed:
    """A `context_length_exceeded` refusal, remembered for the finish answer (http.md §2.3)."""
    trajectory.context_length_exceeded = True
    return TurnFailed(error(dialect, 400, message, CONTEXT_LENGTH_EXCEEDED))


def closed(trajectory: Trajectory, dialect: Dialect) -> Reply:
    """The 410 a call on a trajectory that is no longer open gets."""
    return error(dialect, 410, f"trajectory is {trajectory.status}", "trajectory_closed")

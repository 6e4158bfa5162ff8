"""What a token-mode call answers: the Reply, and the refusals and failures that end a turn
before its commit, raised without a dialect and written in the caller's (http.md §3.2)."""

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


class TurnError(Exception):
    """A turn that ends before its commit (a refusal or an engine failure), said without a
    dialect: the backend writes it as the caller's error body, in one place."""

    def __init__(
        self, status: int, message: str, code: str | None = None, *, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


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


def error_reply(dialect: Dialect, failed: TurnError) -> Reply:
    """The reply a failed turn answers, in the caller's dialect."""
    return error(dialect, failed.status, failed.message, failed.code, param=failed.param)


def too_long(trajectory: Trajectory, message: str) -> TurnError:
    """A `context_length_exceeded` refusal, remembered for the finish answer (http.md §2.3)."""
    trajectory.context_length_exceeded = True
    return TurnError(400, message, CONTEXT_LENGTH_EXCEEDED)


def closed(trajectory: Trajectory) -> TurnError:
    """The 410 a call on a trajectory that is no longer open gets."""
    return TurnError(410, f"trajectory is {trajectory.status}", "trajectory_closed")

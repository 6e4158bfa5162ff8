"""A control-route answer: its status, its JSON body and what to run once it is sent."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from skycap.wire import control_error


@dataclass(frozen=True, slots=True)
class Answer:
    """A control-route answer: status and JSON body bytes, and what to run once it is sent."""

    status: int
    body: bytes
    sent: Callable[[], None] | None = None

    @classmethod
    def json(cls, status: int, value: Any) -> Answer:
        return cls(status, orjson.dumps(value))

    @classmethod
    def error(cls, status: int, message: str, code: str | None = None) -> Answer:
        return cls(status, control_error(message, code))

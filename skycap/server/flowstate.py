"""What skycap keeps on one mitmproxy flow between its hooks, under one `flow.metadata` key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mitmproxy import http

KEY = "skycap"


@dataclass(slots=True)
class FlowState:
    """One flow's route and what its response hooks need.

    `call` is a running call the response hooks complete (text mode's `TextCall`);
    `sent` runs once a control answer is on the wire (the mirror's hold); `streamed` marks
    a reply served from the loopback as it is written (passed through unbuffered);
    `harness_left` marks a flow mitmproxy gave up on; `close_after` a harness that asked
    for `Connection: close`. `websocket` marks a captured WebSocket upgrade and `socket`
    is its session once admitted (`websocket.ResponsesSocket`).
    """

    kind: str | None = None
    trajectory_id: str | None = None
    proxied: bool = False
    call: Any = None
    sent: Callable[[], None] | None = None
    streamed: bool = False
    harness_left: bool = False
    close_after: bool = False
    websocket: bool = False
    socket: Any = None


def state_of(flow: http.HTTPFlow) -> FlowState:
    """The flow's state, made on first use."""
    state = flow.metadata.get(KEY)
    if state is None:
        state = flow.metadata[KEY] = FlowState()
    return state

"""The scripted engine's weight version: set through vLLM's RL routes, reported per token span.

Each rule names the vLLM 0.33 source it mirrors (paths under `vllm/`):
- the engine starts at version "default" (v1/engine/core.py `EngineCore.__init__`
  `_weight_version`), and every engine step's outputs carry the version current then
  (core.py `_attach_weight_version`);
- `POST /update_weight_version {"new_version"}` sets it and answers
  `{"success": true, "new_version"}`; `POST /finish_weight_update {"weight_version"?}`
  sets it when given; `GET /weight_info` answers `{"weight_version"}`
  (entrypoints/rl/online/api_router.py);
- a request starts a span whenever a step's new tokens carry a version other than the last
  span's, at the number of output tokens so far, and reports the spans (each ending where
  the next starts, the last at the output's length) with the finished output only; a
  request whose tokens were never labelled reports None
  (v1/engine/output_processor.py `track_weight_version`, `_weight_version_spans`).
"""

from __future__ import annotations

import threading
from typing import Any

#: vLLM's version before any update (v1/engine/core.py).
DEFAULT_VERSION = "default"


class WeightClock:
    """The engine's current weight version, and scripted switches inside the next completion."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = DEFAULT_VERSION
        self._switches: list[tuple[int, str]] = []

    @property
    def version(self) -> str:
        with self._lock:
            return self._version

    def set(self, version: str) -> None:
        """What `/update_weight_version` and `/finish_weight_update` do."""
        with self._lock:
            self._version = version

    def switch_at(self, token: int, version: str) -> None:
        """Make the next completion switch to `version` before its output token `token`, as
        if the trainer's `/update_weight_version` landed between those engine steps (the
        version then stays)."""
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"token must be an output-token index >= 0, got {token!r}")
        with self._lock:
            self._switches.append((token, version))
            self._switches.sort(key=lambda pair: pair[0])

    def request(self) -> VersionSpans:
        """The span tracker of one new request; it takes the pending scripted switches."""
        with self._lock:
            switches, self._switches = self._switches, []
        return VersionSpans(self, switches)


class VersionSpans:
    """One request's spans, labelled token by token as the engine emits them."""

    def __init__(self, clock: WeightClock, switches: list[tuple[int, str]]) -> None:
        self._clock = clock
        self._switches = switches
        self._starts: list[tuple[str, int]] = []
        self.tokens = 0

    def label(self, count: int) -> None:
        """Label the next `count` output tokens with the version current as each is sampled."""
        for index in range(self.tokens, self.tokens + count):
            while self._switches and self._switches[0][0] <= index:
                self._clock.set(self._switches.pop(0)[1])
            version = self._clock.version
            if not self._starts or self._starts[-1][0] != version:
                self._starts.append((version, index))
        self.tokens += count

    def spans(self) -> list[dict[str, Any]] | None:
        """The finished output's `weight_versions` (output_processor.py `_weight_version_spans`)."""
        if not self._starts and self.tokens:
            return None
        ends = [start for _, start in self._starts[1:]] + [self.tokens]
        # No tokens and no label: vLLM's zip stops at the empty starts, giving [].
        return [
            {"version": version, "start": start, "end": end}
            for (version, start), end in zip(self._starts, ends, strict=False)
        ]

"""skycap: capture what an LLM policy saw and sampled while an agent harness runs, as training data.

Public names are imported lazily, so `import skycap` (and the trainer-side client) never
loads mitmproxy or transformers until a capture server is actually started.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "CaptureError": "skycap.client",
    "CapturePool": "skycap.client",
    "FinishResult": "skycap.client",
    "PathRuleError": "skycap.client",
    "RecordLocation": "skycap.client",
    "Sample": "skycap.client",
    "Trajectory": "skycap.client",
    "CaptureService": "skycap.service",
    "RecordsLost": "skycap.service",
    "load": "skycap.loader",
    "new_run_dir": "skycap.record.layout",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'skycap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))

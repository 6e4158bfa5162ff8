"""Claude Code itself against skycap: a tool round trip on one path, both modes, both routes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import claude_code_smoke as smoke  # noqa: E402

CLAUDE = smoke.find_claude()
pytestmark = pytest.mark.skipif(
    CLAUDE is None and os.environ.get("CI") != "true",
    reason="Claude Code is not installed (.ci/run installs it into .ci/npm)",
)


@pytest.mark.parametrize("route", ["base_url", "proxy"])
@pytest.mark.parametrize("mode", ["text", "tokens"])
def test_claude_code_tool_round_trip_is_one_path(mode: str, route: str) -> None:
    assert CLAUDE is not None, "CI=true: the pinned Claude Code must be installed (.ci/run)"
    outcome = smoke.run_once(CLAUDE, mode, route)
    assert smoke.MARKER in str(outcome.result.get("result")), outcome.result
    (path,) = outcome.tool_paths  # background calls, if any, are other roots
    roles = [m["role"] for m in path["messages"]]
    assert roles[-3:] == ["assistant", "tool", "assistant"]
    call = path["messages"][-3]["tool_calls"][0]
    assert call["function"]["name"] == "Bash" and call["id"].startswith("toolu_")
    assert smoke.MARKER in path["messages"][-2]["content"]
    calls = [c for n in outcome.document["nodes"] for c in n["calls"]]
    assert {c["dialect"] for c in calls} == {"messages"}
    if mode == "tokens":
        tool_calls = [
            c for n in outcome.document["nodes"] for c in n["calls"] if c["tools"] is not None
        ]
        assert [c["bridged"] for c in tool_calls][1:] == [True] * (len(tool_calls) - 1)
        assert 1 in path["loss_mask"]

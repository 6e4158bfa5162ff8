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


def test_claude_code_in_token_mode_outlasts_its_idle_timeout_on_a_slow_stream() -> None:
    """Every reply is silent longer than the idle timeout set through Claude Code's own
    environment (CLAUDE_STREAM_IDLE_TIMEOUT_MS) before its first token, then streams a
    token at a time with ping events in the silence: no call is dropped and retried (a
    retry would sample again) and the tool round trip is one path. (In the pinned version
    the watchdog did not fire at 1 s even without pings, so this guards the slow stream
    itself; Codex's test is the one that fails without keep-alives.)"""
    assert CLAUDE is not None, "CI=true: the pinned Claude Code must be installed (.ci/run)"
    outcome = smoke.run_once(CLAUDE, "tokens", "base_url", slow=True)
    assert smoke.MARKER in str(outcome.result.get("result")), outcome.result
    (path,) = outcome.tool_paths
    assert [m["role"] for m in path["messages"]][-3:] == ["assistant", "tool", "assistant"]
    calls = [c for n in outcome.document["nodes"] for c in n["calls"]]
    assert calls and all(c["t_end"] - c["t_start"] > smoke.SLOW_IDLE_MS / 1000 for c in calls)
    assert outcome.document["failures"] == [] and outcome.document["retries"]["replayed"] == 0

"""Claude Code itself against skycap: a tool round trip on one path, both modes, both routes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

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
    if mode == "text":  # the API's own blocks, sent back by Claude Code, kept on the path
        kept = json.dumps(path["messages"][-3])  # the content and the thinking blocks
        assert all(b["type"] in kept for b in smoke.HOSTED)
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


def _paths(outcome: smoke.Outcome, text: str) -> list[dict[str, Any]]:
    """The samples whose messages mention `text`."""
    return [s for s in outcome.finished["samples"] if text in json.dumps(s["messages"])]


@pytest.mark.parametrize("mode", ["text", "tokens"])
def test_claude_code_background_subagent_is_a_root_of_its_own(mode: str) -> None:
    """At its defaults (adaptive thinking) Claude Code runs its `Agent` tool's subagent in
    the background: the tool result comes back at once, a system notification reaches
    the main conversation when the subagent ends. The main conversation is one path; the
    subagent's calls start a root of their own."""
    assert CLAUDE is not None, "CI=true: the pinned Claude Code must be installed (.ci/run)"
    outcome = smoke.run_once(CLAUDE, mode, "base_url", scenario="subagent")
    assert outcome.result.get("result") == smoke.MARKER, outcome.result
    (main,) = _paths(outcome, smoke.NOTIFICATION)
    roles = [m["role"] for m in main["messages"]]
    assert roles[-5:] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert main["messages"][-5]["tool_calls"][0]["function"]["name"] == "Agent"
    (sub,) = [s for s in _paths(outcome, smoke.SUBAGENT_MARK) if s is not main]
    assert sub["messages"][-1]["content"] == smoke.SUBAGENT_ANSWER
    assert not set(sub["path"]) & set(main["path"])  # its own root


@pytest.mark.parametrize("mode", ["text", "tokens"])
def test_claude_code_compact_is_a_branch_and_its_history_a_new_branch(mode: str) -> None:
    """The task, `/compact`, then a question: the summary request branches off the task's
    path after its last turn; the compacted history the next turn sends branches off
    before the task's first model turn (only the shared system prompt is common)."""
    assert CLAUDE is not None, "CI=true: the pinned Claude Code must be installed (.ci/run)"
    outcome = smoke.run_once(CLAUDE, mode, "base_url", scenario="compact")
    assert outcome.result.get("result") == smoke.MARKER, outcome.result
    (summary,) = _paths(outcome, smoke.SUMMARY_ASK)
    assert "<summary>" in str(summary["messages"][-1]["content"])
    (after,) = _paths(outcome, smoke.CONTINUED)
    (task,) = [s for s in outcome.finished["samples"] if s is not summary and s is not after]
    assert summary["path"][0] == task["path"][0] and summary["path"][-1] not in task["path"]
    shared = len(set(after["path"]) & set(task["path"]))
    assert after["path"][:shared] == task["path"][:shared]
    assert 0 < shared and "assistant" not in [m["role"] for m in after["messages"][:shared]]
    assert after["messages"][-1]["content"] == smoke.MARKER

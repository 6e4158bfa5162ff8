"""The real Codex CLI (`codex exec`) against skycap in both modes, hermetic (no network).

Each run is `scripts/codex_smoke.py`'s: the scripted model asks Codex to run a shell
command, Codex runs it and sends the reasoning item (with its `encrypted_content`), the
call and its output back, and the model answers. Without compaction that is one path.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import codex_smoke  # noqa: E402

BINARY = codex_smoke.codex_binary()
pytestmark = pytest.mark.skipif(
    BINARY is None and os.environ.get("CI") != "true",
    reason="codex not installed (.ci/run installs it into .ci/npm)",
)


def run(
    tmp_path: Path,
    mode: str,
    provider: str,
    compact: bool = False,
    websockets: bool = False,
    defaults: bool = False,
) -> codex_smoke.CodexRun:
    assert BINARY is not None, "CI=true: the Codex CLI must be installed (.ci/run)"
    service, _model, stop_model = codex_smoke.serve(
        mode, provider, compact, tmp_path / "rec", defaults
    )
    url = service.start()
    try:
        return asyncio.run(
            codex_smoke.capture(
                url, BINARY, provider, compact, tmp_path, websockets=websockets, defaults=defaults
            )
        )
    finally:
        service.stop()
        stop_model()


def check_one_path(outcome: codex_smoke.CodexRun, mode: str) -> list[dict[str, Any]]:
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    assert "skycap-smoke" in outcome.stdout + outcome.stderr
    calls = outcome.calls
    assert len(calls) == 2 and all(c["dialect"] == "responses" for c in calls)
    assert [c["finish_reason"] for c in calls] == ["tool_calls", "stop"]
    assert len(outcome.samples) == 1, "Codex's replayed history must stay one path"
    if mode == "tokens":
        assert [c["bridged"] for c in calls] == [None, True]
        (sample,) = outcome.samples
        assert sample.input_ids is not None and sum(sample.loss_mask or []) > 0
    return calls


@pytest.mark.parametrize("mode", ["text", "tokens"])
def test_codex_base_url_provider_is_one_path(tmp_path: Path, mode: str) -> None:
    check_one_path(run(tmp_path, mode, "base-url"), mode)


@pytest.mark.parametrize(
    ("mode", "provider"), [("text", "default"), ("text", "base-url"), ("tokens", "base-url")]
)
def test_codex_at_its_defaults_is_one_path_over_its_websocket(
    tmp_path: Path, mode: str, provider: str
) -> None:
    """No model named, web search and WebSockets as shipped, through the proxy (Codex's own
    provider) or a base-url provider with `supports_websockets`: every call is a WebSocket
    message. Codex's body carries
    its tools in an `additional_tools` item and runs the command through its custom `exec`
    tool; in text mode the answer follows a web search the upstream ran. No 400, no 426."""
    outcome = run(tmp_path, mode, provider, defaults=True)
    calls = check_one_path(outcome, mode)
    assert not outcome.websocket_failures, outcome.stderr[-3000:]
    assert [c["transport"] for c in calls] == ["websocket", "websocket"]
    assert calls[0]["model"] != codex_smoke.MODEL  # Codex's own default model
    (sample,) = outcome.samples
    call, result, answer = sample.messages[-3:]
    assert call["tool_calls"][0]["function"]["name"] == "functions.exec"
    assert "skycap-smoke" in json.dumps(result["content"])  # what `exec` printed
    if mode == "text":  # the web search stays in the answer's turn, as sent
        assert answer["content"][0]["value"] == codex_smoke.WEB_SEARCH


def test_codex_auto_compaction_is_captured_as_its_own_calls(tmp_path: Path) -> None:
    outcome = run(tmp_path, "text", "base-url", compact=True)
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    assert "context compacted" in outcome.stderr
    # The command, the compaction (a summary with no tools), the answer on the new history.
    assert [c["finish_reason"] for c in outcome.calls] == ["tool_calls", "stop", "stop"]
    assert len(outcome.samples) >= 2  # compaction rewrites the history: a fork


def test_codex_remote_compaction_through_the_proxy_is_captured_as_a_call(tmp_path: Path) -> None:
    """Codex's own provider compacts remotely: a call whose input ends in a
    `compaction_trigger` item and whose answer is an opaque `compaction` item, both kept
    as sent. It extends the task's path; the compacted history that follows branches."""
    outcome = run(tmp_path, "text", "default", compact=True)
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    assert "context compacted" in outcome.stderr
    assert [c["finish_reason"] for c in outcome.calls] == ["tool_calls", "stop", "stop"]
    task, after = sorted(outcome.samples, key=lambda s: len(s.messages), reverse=True)
    trigger, compaction = task.messages[-2:]
    assert trigger["content"][0]["value"]["type"] == "compaction_trigger"
    assert compaction["content"][0]["value"] == codex_smoke.REMOTE_COMPACTION
    assert after.messages[-2]["content"][0]["value"] == codex_smoke.REMOTE_COMPACTION


def test_codex_remote_compaction_in_token_mode_is_refused_naming_the_base_url(
    tmp_path: Path,
) -> None:
    outcome = run(tmp_path, "tokens", "default", compact=True)
    assert outcome.returncode != 0
    assert "compaction_trigger" in outcome.stderr and "base_url" in outcome.stderr
    assert [c["finish_reason"] for c in outcome.calls] == ["tool_calls"]


@pytest.mark.parametrize("websockets", [False, True])
def test_codex_in_token_mode_outlasts_its_idle_timeout_on_a_slow_stream(
    tmp_path: Path, websockets: bool
) -> None:
    """Each generation is silent longer than Codex's (shortened) stream idle timeout before
    its first token, then streams slowly; skycap's keep-alives (events, or messages over
    the WebSocket) keep Codex from dropping the stream and retrying (which would sample the
    turn again and fork the path)."""
    assert BINARY is not None, "CI=true: the Codex CLI must be installed (.ci/run)"
    service, engine, stop_model = codex_smoke.serve(
        "tokens", "base-url", False, tmp_path / "rec", keepalive=0.25
    )
    engine.stream_chunk, engine.stream_pause, engine.first_token_delay = 1, 0.02, 1.5
    url = service.start()
    idle = ("model_providers.skycap.stream_idle_timeout_ms=1000",)
    try:
        outcome = asyncio.run(
            codex_smoke.capture(
                url, BINARY, "base-url", False, tmp_path, config=idle, websockets=websockets
            )
        )
    finally:
        service.stop()
        stop_model()
    calls = check_one_path(outcome, "tokens")
    assert all(c["t_end"] - c["t_start"] > 1.0 for c in calls)  # each outlasted the timeout
    assert len(engine.generated) == 2 and all(r.body["stream"] for r in engine.generated)

"""Token mode through the HTTPS_PROXY listener: the scripted engine answers a proxied harness."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_fixtures import Control, ServerThread, control, proxy_confdir, run_harness

from skycap.mock.engine import ScriptedEngine
from skycap.server.options import ServerOptions


@pytest.fixture(scope="module")
def server(
    token_server_options: Callable[..., ServerOptions], proxy_confdir: Path
) -> Iterator[ServerThread]:
    with ServerThread(token_server_options(proxy_port=0, confdir=proxy_confdir)) as server:
        yield server


def test_a_proxied_harness_is_answered_by_the_engine(
    control: Control, scripted_engine: ScriptedEngine
) -> None:
    created = control.create()
    before = len(scripted_engine.requests)
    seen = run_harness(created)
    assert seen["models"] and seen["first"]["role"] == "assistant"
    generated = [r for r in scripted_engine.requests[before:] if r.path.endswith("/generate")]
    assert len(generated) == 2  # the two turns reached the engine through the proxy
    health = control.http.get("/healthz").json()
    assert health["capture"]["mode"] == "tokens" and health["tokens_total"] > 0
    result = control.finish(created["id"]).json()
    assert result["status"] == "finished" and result["samples"]
    sample = max(result["samples"], key=lambda s: len(s["messages"]))
    assert len(sample["input_ids"]) == len(sample["loss_mask"]) == len(sample["logprobs"])
    assert sum(sample["loss_mask"]) > 0
    assert len([m for m in sample["messages"] if m["role"] == "assistant"]) == 2

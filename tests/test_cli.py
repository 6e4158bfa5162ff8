"""The CLI's shared conventions: `-V`, a default on every `--help` line, progress on long
work, and no notice from transformers in skycap's own processes."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skycap.cli.folders import Progress
from skycap.cli.main import build_parser


def test_dash_v_prints_the_version() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "-V"], capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.startswith("skycap ")


def test_every_help_line_shows_its_default() -> None:
    _, commands = build_parser()
    missing = []
    for name, parser in commands.items():
        for action in parser._actions:
            if not action.option_strings or isinstance(
                action, argparse._HelpAction | argparse._VersionAction
            ):
                continue
            if "default" not in (action.help or "").lower():
                missing.append(f"skycap {name} {'/'.join(action.option_strings)}")
    assert not missing, "help without its default: " + ", ".join(missing)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal_only_and_is_erased() -> None:
    terminal = _Terminal()
    with Progress("skycap validate runs/a", 3, stream=terminal, delay=0.0) as progress:
        for _ in range(3):
            progress.step()
    assert terminal.getvalue().startswith("\rskycap validate runs/a: 1/3 records")
    assert terminal.getvalue().endswith("\r\x1b[K")
    pipe = io.StringIO()
    with Progress("skycap summary", 3, stream=pipe, delay=0.0) as progress:
        progress.step(3)
    assert pipe.getvalue() == "" and progress.done == 3


def test_no_pytorch_notice_when_skycap_loads_a_tokenizer(qwen3_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMERS_")}
    plain = subprocess.run(
        [sys.executable, "-c", "import transformers"], capture_output=True, text=True, env=env
    )
    if "PyTorch was not found" not in plain.stderr:
        pytest.skip("this environment has PyTorch: transformers prints no notice to hide")
    code = (
        "import sys; from skycap.tokens.library_renderer import LibraryRenderer; "
        f"LibraryRenderer({str(qwen3_dir)!r}, renderer_name='qwen3'); print('loaded')"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert loaded.stdout.strip() == "loaded", loaded.stderr
    assert "PyTorch" not in loaded.stderr

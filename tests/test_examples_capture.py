"""The capture examples run as written: each script, copied out of the repository, run with
this interpreter from a temporary folder, leaves finished records that `skycap check` reads."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("capture_tokens.py", r"tokens, \d+ trained"),
        ("capture_text.py", r"a path of 7 messages: system user assistant tool"),
        ("capture_proxy.py", r"the harness called https://api\.openai\.com/v1/ and answered 'Done"),
    ],
)
def test_example_runs_as_written(script: str, expected: str, tmp_path: Path) -> None:
    folder = tmp_path / "examples"
    shutil.copytree(EXAMPLES, folder)
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}  # the proxy's CA
    run = subprocess.run(
        [sys.executable, str(folder / script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(expected, run.stdout), run.stdout
    assert "Traceback" not in run.stderr and "PyTorch" not in run.stderr
    finished = re.findall(r"(tr_[0-9a-f]{16}): finished", run.stdout)
    records = sorted(p.name for p in (tmp_path / "records").glob("*.json.zst"))
    assert finished and records == sorted(f"{i}.json.zst" for i in finished)
    check = subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "check", "records"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout
    assert check.stdout.splitlines()[-1] == f"{len(records)} of {len(records)} trajectories linear"

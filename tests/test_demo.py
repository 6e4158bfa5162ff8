"""`skycap demo`, the README's main command, runs end to end and leaves readable records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("mode", ["tokens", "text"])
def test_demo_captures_live_rollouts(mode: str, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "demo", "--mode", mode],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert f"({mode} mode)" in run.stdout
    records = sorted((tmp_path / "records").glob("tr_*.json.zst"))
    assert len(records) == 5
    check = subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "check", str(tmp_path / "records")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # One compaction and one resample fork; the other rollouts are linear.
    assert check.returncode == 1, check.stdout + check.stderr
    assert check.stdout.splitlines()[-1] == (
        "3 of 5 trajectories linear; forks: 1 resample, 1 different message"
    )
    summary = subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "summary", "--json", str(tmp_path / "records")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    stats = json.loads(summary.stdout)[0]["stats"]
    assert stats["status"] == {"finished": 5}
    assert stats["modes"] == {mode: 5}
    if mode == "tokens":
        assert stats["tokens"] > 0 and stats["bridged"]["true"] > 0

"""`skycap demo`, the README's main command, runs end to end and leaves readable records."""

from __future__ import annotations

import contextlib
import io
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
        reproduce_demo_records(tmp_path)


def reproduce_demo_records(tmp_path: Path) -> None:
    """`check --reproduce` passes on the demo's records with the bundled tokenizer, and names
    the first call when the chat template is changed by one token."""
    from skycap.tokens.tokenizer_env import bundled_qwen3_dir

    qwen = bundled_qwen3_dir()
    assert qwen is not None
    records = str(tmp_path / "records")
    code, out = reproduce_run(records, str(qwen))  # the renderer the records name: qwen3
    assert code == 0, out
    assert out.splitlines()[-1].startswith("5 of 5 trajectories reproduce")
    assert reproduce_run(records, str(qwen), "default")[0] == 0  # the jinja template itself

    edited = tmp_path / "edited-tokenizer"
    edited.mkdir()
    for file in qwen.iterdir():
        if file.name != "tokenizer_config.json":
            (edited / file.name).symlink_to(file)
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    assert "one or more functions" in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(
        "one or more functions", "one or several functions"
    )
    (edited / "tokenizer_config.json").write_text(json.dumps(config))
    code, out = reproduce_run(records, str(edited), "default")
    assert code == 1, out
    assert "chat template digest" in out
    assert "call at node 2: prompt differs from token" in out


def reproduce_run(records: str, tokenizer: str, renderer: str | None = None) -> tuple[int, str]:
    """`skycap check --reproduce` in this process (a tokenizer load, not a Python start)."""
    from skycap.cli.main import main

    extra = [] if renderer is None else ["--renderer", renderer]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["check", "--reproduce", records, "--tokenizer", tokenizer, *extra])
    return code, out.getvalue()

"""`skycap demo`, the README's main command, runs end to end and leaves readable records."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from skycap.viewer.index import Index

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def demo(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "demo", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("mode", ["tokens", "text"])
def test_demo_captures_live_rollouts(mode: str, tmp_path: Path) -> None:
    run = demo(tmp_path, "--mode", mode)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert f"({mode} mode)" in run.stdout
    (folder,) = (tmp_path / "records").glob("demo-*")  # a run folder of its own
    records = sorted(folder.glob("tr_*.json.zst"))
    assert len(records) == 5
    check = subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "check", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # One compaction and one resample fork; the other rollouts are linear.
    assert check.returncode == 1, check.stdout + check.stderr
    assert check.stdout.splitlines()[-1] == (
        "3 of 5 trajectories linear; forks: 1 resample, 1 compaction"
    )
    assert "compaction: a user message in place of the" in check.stdout
    summary = subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "summary", "--json", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    stats = json.loads(summary.stdout)[0]["stats"]
    assert stats["status"] == {"finished": 5}
    assert stats["modes"] == {mode: 5}
    if mode == "tokens":
        assert stats["tokens"] > 0 and stats["bridged"]["true"] > 0
        reproduce_demo_records(tmp_path, folder)


def reproduce_demo_records(tmp_path: Path, folder: Path) -> None:
    """`check --reproduce` passes on the demo's records with the bundled tokenizer, and names
    the first call when the chat template is changed by one token."""
    from skycap.tokens.tokenizer_env import bundled_qwen3_dir

    qwen = bundled_qwen3_dir()
    assert qwen is not None
    records = str(folder)
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


def test_runs_do_not_mix(tmp_path: Path) -> None:
    """The demo twice and an example under one ./records: three runs, apart, in the viewer."""
    for _ in range(2):
        assert demo(tmp_path, "--mode", "text").returncode == 0
    example = subprocess.run(
        [sys.executable, str(EXAMPLES / "capture_text.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert example.returncode == 0, example.stderr
    runs = {run["name"]: run for run in Index([tmp_path / "records"]).listing()}
    demos = sorted(name for name in runs if name.startswith("demo-"))
    examples = [name for name in runs if name.startswith("capture_text-")]
    assert len(runs) == 3 and len(demos) == 2 and len(examples) == 1, list(runs)
    assert [runs[name]["trajectories"] for name in [*demos, *examples]] == [5, 5, 1]

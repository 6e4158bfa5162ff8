"""Every script in examples/ runs as written: with this interpreter, from a temporary folder,
printing what it promises. Add an example's expected lines to EXPECTED to test it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

#: Script name -> lines its output must contain.
EXPECTED: dict[str, list[str]] = {
    "grpo_openai.py": [
        "step 0: GRPO batch of 16 trained rows",
        "step 1: GRPO batch of 16 trained rows",
        "retried_rollouts=1",
        "record log: 17 attempts, 1 superseded",
        "forks=0",
        "num_unbridged_calls=0",
        "masked_trajectories=0",
    ],
    "grpo_litellm.py": [
        "step 0: GRPO batch of 16 trained rows",
        "retried_rollouts=1",
        "forks=0",
        "num_unbridged_calls=0",
        "step rows: 32 (one per model call)",
    ],
    "skyrl_generator.py": [
        "step 1: 8 step-wise rows from 4 rollouts, valid",
        "generate/retried_rollouts=1",
        "generate/num_unbridged_calls=0",
        "generate/placeholder_rows=0",
        "routed experts: ",
    ],
}


def test_every_example_script_is_run_here_and_helpers_are_apart() -> None:
    """A script at the top of examples/ runs and prints; helper modules sit in helpers/."""
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted([*EXPECTED, *CAPTURE])
    for name in scripts:
        assert 'if __name__ == "__main__":' in (EXAMPLES / name).read_text(), name
    for helper in (EXAMPLES / "helpers").glob("*.py"):
        assert 'if __name__ == "__main__":' not in helper.read_text(), helper.name


def run_folder(cwd: Path, script: str) -> Path:
    """The one new run folder the script made under ./records, named after it."""
    (folder,) = (cwd / "records").glob(f"{script.removesuffix('.py')}-*")
    return folder


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_example_runs_and_prints_what_it_promises(name: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    missing = [line for line in EXPECTED[name] if line not in done.stdout]
    assert not missing, f"{name} did not print {missing}:\n{done.stdout}"
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    assert any(run_folder(tmp_path, name).glob("tr_*.json.zst"))  # its records, in its run


#: The capture examples -> a pattern their output must match.
CAPTURE = {
    "capture_tokens.py": r"tokens, \d+ trained",
    "capture_text.py": r"a path of 7 messages: system user assistant tool",
    "capture_proxy.py": r"the harness called https://api\.openai\.com/v1/ and answered 'Done",
}


@pytest.mark.parametrize("script", sorted(CAPTURE))
def test_a_capture_example_leaves_records_check_reads(script: str, tmp_path: Path) -> None:
    """Copied out of the repository, the capture examples print what they promise and leave
    finished records that `skycap check` reads as linear."""
    expected = CAPTURE[script]
    copied = tmp_path / "examples"
    shutil.copytree(EXAMPLES, copied)
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}  # the proxy's CA
    run = subprocess.run(
        [sys.executable, str(copied / script)],
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
    folder = run_folder(tmp_path, script)
    records = sorted(p.name for p in folder.glob("*.json.zst"))
    assert finished and records == sorted(f"{i}.json.zst" for i in finished)
    assert f"inspect them: uv run skycap check records/{folder.name};" in run.stdout
    check = subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "check", str(folder)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout
    assert check.stdout.splitlines()[-1] == f"{len(records)} of {len(records)} trajectories linear"

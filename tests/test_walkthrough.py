"""docs/walkthrough.md's shell session runs as written: serve, create with the control token
file, a harness on the openai SDK, the finish answer, the record read back.

A scripted OpenAI server stands in for the engine (the block's `ENGINE=` line), the port
is a free one, and `uv run` is this interpreter (the environment is already synced)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from skycap.demo import text_mode_script
from skycap.mock.upstream import ScriptedUpstream

WALKTHROUGH = Path(__file__).resolve().parent.parent / "docs" / "walkthrough.md"


def session() -> str:
    (block,) = re.findall(r"^```bash\n(.*?)^```", WALKTHROUGH.read_text(), re.S | re.M)
    return block


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    script = session()
    assert "ENGINE=http://127.0.0.1:8000/v1\n" in script and "8090" in script
    with ScriptedUpstream(text_mode_script) as engine:
        script = script.replace("ENGINE=http://127.0.0.1:8000/v1", f"ENGINE={engine.base_url}")
        script = script.replace("8090", str(free_port()))
        script = script.replace("uv run skycap", f"{sys.executable} -m skycap.cli.main")
        script = script.replace("uv run python", sys.executable)
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        done = subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    answer = json.loads(out.splitlines()[0])  # the create answer, echoed
    assert list(answer) == ["id", "base_url", "anthropic_base_url", "api_key"]
    assert answer["api_key"].startswith("sk-skycap-")
    assert "harness got: Done" in out
    record = tmp_path / "records" / "walkthrough" / f"{answer['id']}.json.zst"
    assert f"finished\n{record}\n" in out
    assert out.splitlines()[-1] == "1 of 1 trajectories linear"
    assert "skycap serve: stopped; no trajectory was open" in done.stderr
    assert "Traceback" not in done.stderr

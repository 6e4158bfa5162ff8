"""`skycap view` from the command line: it serves, says where, and refuses bad usage."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_viewer_fixtures import Build, tid

from skycap.cli.main import main


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cli") / "run"
    build = Build(tid(1), mode="text", annotations={"reward": 1.0})
    build.chat(1)
    build.write(directory)
    return directory


def test_view_serves_the_api_and_prints_its_url(record_dir: Path):
    process = subprocess.Popen(
        [sys.executable, "-m", "skycap.cli.main", "view", str(record_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        assert match, line
        assert "1 run(s), 1 record(s)" in line
        runs = httpx.get(f"{match[1]}api/v1/runs", timeout=10).json()["runs"]
        assert [(r["name"], r["trajectories"]) for r in runs] == [("run", 1)]
    finally:
        process.terminate()
        process.wait(timeout=10)


def run_view(capsys, *args: str) -> tuple[int, str]:
    try:
        code = main(["view", *args])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_view_usage_errors(capsys, record_dir: Path):
    assert run_view(capsys)[0] == 2
    code, err = run_view(capsys, "/no/such/dir")
    assert code == 2 and "/no/such/dir is not a directory" in err
    code, err = run_view(capsys, str(record_dir), "--group-by", ",")
    assert code == 2 and "--group-by ',' names no key" in err


def test_view_on_a_busy_port_says_so(capsys, record_dir: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = run_view(capsys, str(record_dir), "--port", str(port))
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err

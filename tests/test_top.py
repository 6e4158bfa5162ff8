"""`skycap top`: a snapshot of live trajectories, and the live view under tmux."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from openai import OpenAI

from skycap import CaptureService
from skycap.mock.upstream import ScriptedUpstream


@pytest.fixture
def server() -> Iterator[tuple[CaptureService, ScriptedUpstream]]:
    with ScriptedUpstream() as upstream:
        service = CaptureService(upstream.base_url)
        service.start()
        try:
            yield service, upstream
        finally:
            service.stop()


def _create(url: str, meta: dict) -> dict:
    import httpx

    from skycap.control_token import find_control_token

    headers = {"Authorization": f"Bearer {find_control_token(url)}"}
    return httpx.post(f"{url}/trajectories", json={"meta": meta}, headers=headers).json()


def _call(created: dict, content: str, temperature: float = 0.5) -> None:
    client = OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], temperature=temperature
    )


def _top(url: str, *args: str) -> subprocess.CompletedProcess:
    """`top --once` in a subprocess, given the in-process server's token the default way."""
    from skycap.control_token import find_control_token

    env = {**os.environ, "SKYCAP_CONTROL_TOKEN": find_control_token(url) or ""}
    return subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "top", "--once", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_once_prints_servers_and_live_trajectories(server) -> None:
    service, _ = server
    forked = _create(service.url, {"task": "forky", "step": 7})
    linear = _create(service.url, {"task": "plain", "step": 8})
    _call(forked, "q")
    _call(forked, "q", temperature=1.0)  # the same prompt sampled again: 2 paths
    _call(linear, "r")
    run = _top(service.url, "http://127.0.0.1:9")
    assert run.returncode == 1, run.stderr  # one server is down
    assert _top(service.url).returncode == 0
    lines = run.stdout.splitlines()
    server_row = next(line for line in lines if service.url in line)
    assert "up, text mode" in server_row
    assert any("127.0.0.1:9" in line and "down: connection refused" in line for line in lines)
    # Cells: id, task, step, status, age, calls, nodes, paths, unbridged, failures, ms, finish.
    row = _cells(next(line for line in lines if forked["id"] in line))
    assert row[0] == f"{forked['id']} @{service.url}"
    assert row[1:4] == ["forky", "7", "open"]
    assert row[5:10] == ["2", "3", "2", "0", "0"] and row[-1] == "stop"
    row = _cells(next(line for line in lines if linear["id"] in line))
    assert row[1:4] == ["plain", "8", "open"] and row[5:8] == ["1", "2", "1"]
    assert "live trajectories (2), sorted by age" in run.stdout


def _cells(line: str) -> list[str]:
    """A row's cells: columns are separated by at least two spaces (cells hold none)."""
    return [cell.strip() for cell in re.split(r"\s{2,}", line.strip())]


def test_usage_errors() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "skycap.cli.main", "top", "--interval", "0", "http://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--interval must be positive" in run.stderr


def _wait_for(pane: Callable[[], str], text: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = pane()
        if text in screen:
            return screen
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared on screen:\n{screen}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_view_updates_and_survives_the_server_going_away(server) -> None:
    service, _ = server
    session = f"skycap-top-{uuid.uuid4().hex[:8]}"
    # pytest exports COLUMNS=80/LINES=24, which would pin the pane's width.
    command = f"env -u COLUMNS -u LINES TOP_TOKEN={service.control_token} {sys.executable} "
    command += f"-m skycap.cli.main top --control-token-env TOP_TOKEN --interval 0.2 {service.url}"
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "50", command], check=True
    )

    def pane() -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True
        ).stdout

    try:
        _wait_for(pane, "live trajectories (0)")
        created = _create(service.url, {"task": "live", "step": 1})
        for turn in range(3):
            _call(created, f"turn {turn}")
        screen = _wait_for(pane, created["id"])
        assert "live trajectories (1)" in screen
        subprocess.run(["tmux", "send-keys", "-t", session, "c"], check=True)
        _wait_for(pane, "sorted by calls")
        service.stop()
        _wait_for(pane, "down: connection refused")
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = subprocess.run(["tmux", "has-session", "-t", session], capture_output=True)
            if alive.returncode != 0:
                break
            time.sleep(0.1)
        assert alive.returncode != 0, "skycap top did not quit on q"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)

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
    assert any("127.0.0.1:9 down: connection refused" in line for line in lines)
    header = _cells(next(line for line in lines if line.startswith("id ")))
    assert header[:8] == ["id", "srv", "status", "task", "step", "calls", "idle", "fail"]
    assert header[-5:] == ["ms", "finish", "nodes", "unbr", "last error"]
    row = dict(
        zip(header, _cells(next(line for line in lines if forked["id"] in line)), strict=False)
    )
    assert row["srv"] == "1" and row["task"] == "forky" and row["step"] == "7"
    assert (row["status"], row["calls"], row["paths"], row["fail"]) == ("open", "2", "2", "0")
    assert row["nodes"] == "3" and row["finish"] == "stop"
    row = dict(
        zip(header, _cells(next(line for line in lines if linear["id"] in line)), strict=False)
    )
    assert (row["task"], row["step"], row["calls"], row["nodes"]) == ("plain", "8", "1", "2")
    assert "live trajectories (2), by age" in run.stdout
    total = _cells(next(line for line in lines if line.startswith("all 1 of 2 up")))
    assert total[3] == "3"  # calls over the servers that are up
    # docs/tools.md: the token columns are token mode's; a text-mode server shows none.
    servers = _cells(next(line for line in lines if line.startswith("server ")))
    text_row = dict(
        zip(
            servers,
            _cells(next(line for line in lines if "(text" in line or " text " in line)),
            strict=False,
        )
    )
    assert text_row["tokens"] == "-" and dict(zip(servers, total, strict=False))["tokens"] == "-"


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


class Pane:
    """`skycap top` running in a detached tmux session of a fixed size."""

    def __init__(self, service: CaptureService, width: int, height: int) -> None:
        self.session = f"skycap-top-{uuid.uuid4().hex[:8]}"
        # pytest exports COLUMNS=80/LINES=24, which would pin the pane's width.
        command = f"env -u COLUMNS -u LINES TOP_TOKEN={service.control_token} {sys.executable} "
        command += "-m skycap.cli.main top --control-token-env TOP_TOKEN --interval 0.2 "
        command += str(service.url)
        subprocess.run(
            [
                "tmux",
                "new-session",
                "-d",
                "-s",
                self.session,
                "-x",
                str(width),
                "-y",
                str(height),
                command,
            ],
            check=True,
        )

    def screen(self) -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", self.session], capture_output=True, text=True
        ).stdout

    def wait_for(self, text: str) -> str:
        return _wait_for(self.screen, text)

    def keys(self, *keys: str, literal: bool = False) -> None:
        flags = ["-l"] if literal else []
        subprocess.run(["tmux", "send-keys", "-t", self.session, *flags, *keys], check=True)

    def closed(self) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = subprocess.run(["tmux", "has-session", "-t", self.session], capture_output=True)
            if alive.returncode != 0:
                return True
            time.sleep(0.1)
        return False

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


@needs_tmux
def test_live_view_updates_and_survives_the_server_going_away(server) -> None:
    service, _ = server
    pane = Pane(service, 160, 50)
    try:
        pane.wait_for("live trajectories (0)")
        created = _create(service.url, {"task": "live", "step": 1})
        for turn in range(3):
            _call(created, f"turn {turn}")
        screen = pane.wait_for(created["id"])
        assert "live trajectories (1)" in screen
        pane.keys("c")
        pane.wait_for("live trajectories (1), by calls")
        service.stop()
        pane.wait_for("down: connection refused")
        pane.keys("q")
        assert pane.closed(), "skycap top did not quit on q"
    finally:
        pane.kill()


@pytest.fixture(scope="module")
def token_run(token_server_options, scripted_engine, tmp_path_factory):
    """A token-mode server with 20 trajectories: 4 with a failed call, 3 idle, 2 finished."""
    import httpx
    import openai

    from skycap.service import CaptureService

    options = token_server_options(record_dir=tmp_path_factory.mktemp("records"))
    service = CaptureService(**{f: getattr(options, f) for f in _init_fields(options)})
    service.start()
    created = []
    try:
        for i in range(20):
            meta = {"task": f"tasks/alpha-{i % 4}", "step": i % 3, "instance_id": f"inst-{i}"}
            trajectory = _create(service.url, meta)
            created.append(trajectory)
            client = openai.OpenAI(
                base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
            )
            messages = [{"role": "user", "content": f"question {i}"}]
            if i % 5 == 0:
                scripted_engine.fail_next("http_500")
                with pytest.raises(openai.InternalServerError):
                    client.chat.completions.create(model="p", messages=messages)
            if i % 7 == 3:
                continue  # idle: created, never called
            client.chat.completions.create(model="p", messages=messages)
        for trajectory in created[-2:]:
            finished = httpx.post(
                f"{service.url}/trajectories/{trajectory['id']}/finish",
                json={"annotations": {"reward": 0.5}},
                headers={"Authorization": f"Bearer {service.control_token}"},
            )
            assert finished.status_code == 200
        yield service, created
    finally:
        service.stop()


def _init_fields(options) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(options) if f.init]


def _health(service: CaptureService) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {service.control_token}"}
    return httpx.get(f"{service.url}/healthz", headers=headers).json()


def _numbers_whole(screen: str) -> None:
    """No cell is cut but free text: the last column, or the last error line."""
    for line in screen.splitlines():
        if "…" in line:
            assert line.endswith("…") and line.count("…") == 1, f"a cut cell: {line!r}"


@needs_tmux
def test_top_holds_a_token_run_at_80x24(token_run) -> None:
    service, created = token_run
    health = _health(service)
    assert health["failures_total"] == 4 and health["ended_total"] == 2
    pane = Pane(service, 80, 24)
    try:
        screen = pane.wait_for("live trajectories (18)")
        lines = screen.splitlines()
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
        _numbers_whole(screen)
        header = _cells(lines[0])
        assert header == [
            "server",
            "mode",
            "open",
            "calls",
            "fail",
            "ended",
            "tokens",
            "calls/s",
            "tok/s",
        ]
        server_row = dict(zip(header, _cells(lines[1]), strict=False))
        assert server_row["mode"] == "tokens" and server_row["open"] == "18"
        assert server_row["fail"] == str(health["failures_total"])
        assert server_row["calls"] == str(health["calls_total"])
        assert server_row["ended"] == "2"
        assert lines[2].startswith("last error ") and "scripted engine" in lines[2]
        columns = _cells(next(line for line in lines if line.startswith("id ")))
        assert columns[:7] == ["id", "status", "task", "step", "calls", "idle", "fail"]
        # Scrolling: 18 rows do not fit under the header; the newest comes into view.
        assert "rows 1-17 of 18" in screen and created[17]["id"] not in screen
        pane.keys("G")
        pane.wait_for(created[17]["id"])
        # The filter matches the raw meta task; a failed trajectory's detail shows the error.
        pane.keys("/")
        pane.keys("task:tasks/alpha-1 step:2", literal=True)
        pane.keys("Enter")
        # The applied filter shows its count; the line being typed does not (Enter pending).
        screen = pane.wait_for("(2 of 18")
        expected = [t["id"] for i, t in enumerate(created[:18]) if i % 4 == 1 and i % 3 == 2]
        assert "filter: task:tasks/alpha-1 step:2" in screen
        assert all(e in screen for e in expected)
        pane.keys("Escape")
        pane.keys("/")
        pane.keys(f"id:{created[10]['id']}", literal=True)
        pane.keys("Enter", "Enter")
        screen = pane.wait_for("recent calls, newest first")
        assert f"trajectory {created[10]['id']}" in screen and "error 500" in screen
        assert "failures 1" in screen and "end it with POST /trajectories/" in screen
        assert "step=1" in screen and "instance_id=inst-10" in screen
        _numbers_whole(screen)
        pane.keys("Escape")
        pane.wait_for("(1 of 18, filter")
        pane.keys("Escape", "r")
        screen = pane.wait_for("recently ended (2)")
        assert all(t["id"] in screen for t in created[-2:])
        pane.keys("Escape", "r")  # back to the live list: a sort key twice reverses it
        pane.keys("c")
        pane.wait_for("live trajectories (18), by calls")
        pane.keys("c")
        pane.wait_for("live trajectories (18), by calls, reversed")
        pane.keys("?")
        screen = pane.wait_for("skycap top: keys")
        assert "l=latency" in screen and "the same key again: reverse" in screen
        _numbers_whole(screen)  # no help line is cut at 80 columns
        pane.keys("Escape")
        pane.wait_for("live trajectories (18)")
        pane.keys("q")
        assert pane.closed(), "skycap top did not quit on q"
    finally:
        pane.kill()


@needs_tmux
def test_top_shows_every_column_at_160x45(token_run) -> None:
    service, created = token_run
    health = _health(service)
    pane = Pane(service, 160, 45)
    try:
        screen = pane.wait_for("live trajectories (18)")
        _numbers_whole(screen)
        lines = screen.splitlines()
        columns = _cells(next(line for line in lines if line.startswith("id ")))
        assert columns[-5:] == ["ms", "finish", "nodes", "unbr", "last error"]
        assert "rows 1-" not in screen  # everything fits
        row = _cells(next(line for line in lines if created[5]["id"] in line))
        assert row[-1].startswith('{"error":{"message":"s')  # the last failure's text
        server_row = dict(zip(_cells(lines[0]), _cells(lines[1]), strict=False))
        assert server_row["fail"] == str(health["failures_total"])
        # A call retried after an engine failure renders its prompt from the render cache.
        hits, held = server_row["cache hits"].split()
        assert hits == str(health["render_cache_hits"]) and int(hits) > 0
        assert held.endswith("B") and health["render_cache_bytes"] > 0
    finally:
        pane.kill()


def test_keys_filters_and_fitting() -> None:
    from skycap.cli.top import parse_keys
    from skycap.dashboard.entries import Entry, matches
    from skycap.dashboard.layout import Column, compact, duration, fit
    from skycap.dashboard.poll import ServerState

    assert parse_keys(b"\x1b[Aj\x1b[6~\r\x1b/\x7f") == [
        "up",
        "j",
        "pgdn",
        "enter",
        "esc",
        "/",
        "backspace",
    ]
    entry = Entry(
        ServerState("u"),
        1,
        {"id": "tr_ab", "status": "failed", "meta": {"task_id": "tasks/alpha", "step": 12}},
    )
    assert matches(entry, "task:tasks/alpha") and matches(entry, "alpha step:12")
    assert matches(entry, "status:fail id:tr_a") and not matches(entry, "step:1")
    assert not matches(entry, "task:beta") and matches(entry, "")
    assert [compact(v) for v in (7, 12_345, 4_560_000, 999)] == ["7", "12.3k", "4.56M", "999"]
    assert [duration(s) for s in (5, 185, 7620, 90000)] == ["5s", "3m05s", "2h07m", "1d01h"]
    numbers = [Column(f"n{i}", lambda r, i=i: f"{r * 10**i:,}", i) for i in range(6)]
    text = Column("text", lambda r: "x" * 50, 2, flex=True, min_width=6)
    layout = fit([numbers[0], text, *numbers[1:]], [123456], 60)
    widths = {column.header: width for column, width in layout}
    assert all(widths[c.header] == len(c.cell(123456)) for c in numbers if c.header in widths)
    assert "n5" not in widths and 6 <= widths["text"] < 50
    assert sum(widths.values()) + 2 * (len(widths) - 1) <= 60

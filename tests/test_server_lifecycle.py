"""Lifecycle with a record directory: records, TTL, shutdown and restart, keys, write failures."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import (
    Control,
    ServerThread,
    make_server,
    record_files,
    upstream,
    wait_for,
)

from skycap.mock.upstream import ScriptedUpstream
from skycap.record.reader import read_document
from skycap.server.options import ServerOptions


def chat(trajectory: dict[str, Any], text: str = "hi", key: str | None = None) -> httpx.Response:
    return httpx.post(
        f"{trajectory['base_url']}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": text}]},
        headers={"Authorization": f"Bearer {key or trajectory['api_key']}"},
        timeout=10,
    )


def test_finish_writes_the_record_and_the_disk_answers_afterwards(
    make_server, tmp_path: Path
) -> None:
    server = make_server(record_dir=tmp_path, record_host="10.1.2.3")
    control = Control(server.url)
    trajectory = control.create({"task": 1})
    assert chat(trajectory).status_code == 200
    result = control.finish(trajectory["id"], annotations={"reward": 1}).json()
    path = tmp_path / f"{trajectory['id']}.json.zst"
    assert result["record"] == {
        "host": "10.1.2.3",
        "path": str(path),
        "mirror": None,
        "files": [path.name],
        "mirror_state": None,
        "mirror_error": None,
    }
    stored = read_document(path)
    assert stored["status"] == "finished" and stored["ended"] is True
    assert stored["annotations"] == {"reward": 1} and stored["samples"]["paths"] == "all"
    # Written means gone from memory: the disk answers from now on.
    assert server.run_in_loop(lambda: server.store.get(trajectory["id"])) is None
    assert control.document(trajectory["id"]).json() == stored
    gone = chat(trajectory)
    assert gone.status_code == 410
    assert gone.json()["error"] == {
        "message": "trajectory has ended",
        "type": "invalid_request_error",
        "param": None,
        "code": "trajectory_closed",
    }
    assert control.finish(trajectory["id"], annotations={"reward": 1}).json() == result
    assert control.finish(trajectory["id"], annotations={"reward": 2}).status_code == 409
    added = control.finish(trajectory["id"], annotations={"judge": "late"})
    assert added.status_code == 200
    assert read_document(path)["annotations"] == {"reward": 1, "judge": "late"}
    control.close()


def test_idle_trajectories_are_abandoned_and_can_still_be_rewarded(
    make_server, tmp_path: Path
) -> None:
    server = make_server(record_dir=tmp_path, ttl=0.3, sweep_interval=0.05)
    control = Control(server.url)
    idle = control.create()
    assert chat(idle).status_code == 200
    path = tmp_path / f"{idle['id']}.json.zst"
    wait_for(path.exists, timeout=5, what="the TTL sweep to write the idle trajectory")
    assert read_document(path)["status"] == "abandoned"
    result = control.finish(idle["id"], annotations={"reward": 0.5}).json()
    assert result["status"] == "abandoned" and len(result["samples"]) == 1
    stored = read_document(path)
    assert stored["annotations"] == {"reward": 0.5} and stored["samples"] is not None
    control.close()


def test_shutdown_writes_open_trajectories_and_a_restart_finishes_them(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    options = ServerOptions(upstream.base_url, record_dir=tmp_path)
    first = ServerThread(options)
    control = Control(first.start())
    live = [control.create({"n": i}) for i in range(3)]
    for trajectory in live:
        assert chat(trajectory).status_code == 200
    empty = control.create()
    control.close()
    first.stop()
    assert len(record_files(tmp_path)) == 4
    stored = read_document(tmp_path / f"{live[0]['id']}.json.zst")
    assert stored["status"] == "open" and stored["ended"] is False

    second = ServerThread(options)
    control = Control(second.start())
    moved = {**live[0], "base_url": f"{second.url}/t/{live[0]['id']}/v1"}
    try:
        refused = chat(moved)
        assert refused.status_code == 410
        assert refused.json()["error"]["code"] == "trajectory_closed"
        assert refused.json()["error"]["message"] == (
            "trajectory was written to disk when the server stopped; it takes no more calls, "
            f"finish it with POST /trajectories/{live[0]['id']}/finish"
        )
        result = control.finish(live[0]["id"], annotations={"reward": 1}).json()
        assert result["status"] == "finished" and len(result["samples"]) == 1
        assert read_document(tmp_path / f"{live[0]['id']}.json.zst")["ended"] is True
        ended = chat(moved)  # the record is ended now: the ordinary message again
        assert ended.status_code == 410
        assert ended.json()["error"]["message"] == "trajectory has ended"
        empty_result = control.finish(empty["id"]).json()
        assert empty_result["samples"] == [] and empty_result["status"] == "finished"
    finally:
        control.close()
        second.stop()


def test_require_api_key(make_server, tmp_path: Path) -> None:
    server = make_server(require_api_key=True, record_dir=tmp_path)
    control = Control(server.url)
    mine, other = control.create(), control.create()
    url = f"{mine['base_url']}/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    required = "this trajectory's api_key is required"
    wrong = f"{required}: the key sent is not this trajectory's"
    for headers, message in [
        ({}, required),
        (
            {"Authorization": mine["api_key"]},
            f"{required}: send it as `Authorization: Bearer <api_key>` or `x-api-key`",
        ),
        ({"Authorization": "Bearer sk-skycap-guess"}, wrong),
        ({"Authorization": f"Bearer {other['api_key']}"}, wrong),
        ({"Authorization": b"Bearer \xff\xfe"}, wrong),
    ]:
        refused = httpx.post(url, json=body, headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.json()["error"]["message"].startswith(required)
        assert refused.json()["error"]["message"] == message
    assert httpx.get(f"{mine['base_url']}/models").status_code == 401
    accepted = httpx.post(url, json=body, headers={"Authorization": f"bearer\t {mine['api_key']}"})
    assert accepted.status_code == 200
    control.finish(mine["id"])
    assert chat(mine).status_code == 410  # ended: 410 whatever key is sent
    assert chat(mine, key="wrong").status_code == 410
    assert server.run_in_loop(lambda: server.store.get(other["id"]).trajectory.failures) == []
    control.close()


def test_a_failed_write_keeps_the_trajectory_for_a_later_finish(
    make_server, tmp_path: Path
) -> None:
    record_dir = tmp_path / "records"
    server = make_server(record_dir=record_dir)
    control = Control(server.url)
    trajectory = control.create()
    assert chat(trajectory).status_code == 200
    shutil.rmtree(record_dir)
    record_dir.write_text("not a directory")
    failed = control.finish(trajectory["id"], annotations={"reward": 1}).json()
    assert failed["status"] == "finished" and failed["record"] is None
    assert len(failed["samples"]) == 1
    assert control.document(trajectory["id"]).json()["ended"] is True  # still in memory
    record_dir.unlink()
    record_dir.mkdir()
    retried = control.finish(trajectory["id"], annotations={"reward": 1}).json()
    assert retried["record"]["path"] == str(record_dir / f"{trajectory['id']}.json.zst")
    assert retried["samples"] == failed["samples"]
    control.close()


@pytest.mark.parametrize("mode", ["finish", "ttl"])
def test_records_pass_skycap_check(make_server, tmp_path: Path, mode: str, capsys) -> None:
    from skycap.cli.main import main

    # A TTL that a loaded machine's create-to-call gap cannot reach before the call.
    server = make_server(record_dir=tmp_path, ttl=1.5, sweep_interval=0.05)
    control = Control(server.url)
    trajectory = control.create()
    assert chat(trajectory).status_code == 200
    if mode == "finish":
        control.finish(trajectory["id"])
    else:
        wait_for(lambda: record_files(tmp_path), 15, what="the TTL write")
    control.close()
    assert main(["check", str(tmp_path)]) == 0
    status = "finished" if mode == "finish" else "abandoned"
    assert f"{trajectory['id']}  {status}  linear" in capsys.readouterr().out

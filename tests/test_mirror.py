"""The record mirror against a real S3 API (moto on loopback): copies, finish's location, faults.

Every fault test checks the same three things: nothing is lost locally, the server keeps
serving, and the `/healthz` counters say what happened.
"""
# ruff: noqa: F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from mirror_fixtures import S3, FaultProxy, s3_options
from server_fixtures import Control, make_server, upstream, wait_for  # noqa: F401

from skycap.record.journal import Journal
from skycap.record.mirror import MirrorConfig, RecordMirror, open_store
from skycap.server.options import ServerOptions, from_values
from skycap.trajectory import Trajectory

FAST = {"backoff": 0.01, "timeout": 20.0}


def mirror_options(
    s3: S3, endpoint: str | None = None, prefix: str = "run-7", **config: Any
) -> dict[str, Any]:
    bucket = s3.bucket()
    url = f"s3://{bucket}/{prefix}"
    storage = s3_options(endpoint or s3.endpoint)
    return {
        "record_mirror": url,
        "record_mirror_config": {**FAST, **config, "storage_options": storage},
    }


def one_call(control: Control, meta: dict[str, Any] | None = None) -> str:
    trajectory = control.create(meta or {})
    client = openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content
    return trajectory["id"]


def record_state(control: Control, trajectory_id: str) -> dict[str, Any]:
    response = control.http.get(f"/trajectories/{trajectory_id}/record")
    assert response.status_code == 200, response.text
    return response.json()


def settled(control: Control, trajectory_id: str, timeout: float = 20.0) -> dict[str, Any]:
    return wait_for(
        lambda: (r := record_state(control, trajectory_id))["mirror_state"] != "pending" and r,
        timeout,
        f"the mirror copy of {trajectory_id} to settle",
    )


def counters(control: Control) -> dict[str, Any]:
    return control.http.get("/healthz").json()["record_mirror"]


def serving(control: Control) -> None:
    """The server still takes trajectories and calls."""
    assert control.http.get("/healthz").json()["ok"] is True
    assert one_call(control)


# -- options -----------------------------------------------------------------------------------


def test_mirror_options_are_checked_at_start(tmp_path: Path) -> None:
    base = {"upstream_url": "http://127.0.0.1:9/v1", "record_dir": tmp_path}
    with pytest.raises(ValueError, match=r"record_dir \(--record-dir\)"):
        ServerOptions(upstream_url="http://127.0.0.1:9/v1", record_mirror="memory://m")
    with pytest.raises(TypeError, match="unknown key 'wokers'"):
        ServerOptions(**base, record_mirror="memory://m", record_mirror_config={"wokers": 2})
    with pytest.raises(TypeError, match="list of sidecar kinds"):
        ServerOptions(**base, record_mirror="memory://m", record_mirror_config={"exclude": "x"})
    with pytest.raises(ValueError, match="known kinds: tokens, experts, sampling_mask"):
        ServerOptions(
            **base, record_mirror="memory://m", record_mirror_config={"exclude": ["routing"]}
        )
    with pytest.raises(ValueError, match="workers must be >= 1"):
        ServerOptions(**base, record_mirror="memory://m", record_mirror_config={"workers": 0})
    with pytest.raises(ValueError, match="needs record_mirror"):
        ServerOptions(**base, record_mirror_config={"workers": 2})
    # gcsfs is not installed: the error names both ways to install the extra.
    with pytest.raises(ImportError) as missing:
        ServerOptions(**base, record_mirror="gs://bucket/prefix")
    assert "skycap[remote]" in str(missing.value)
    assert "uv sync --extra remote" in str(missing.value)
    with pytest.raises(ValueError, match="not a usable fsspec URL"):
        ServerOptions(**base, record_mirror="nosuchprotocol://x")


def test_credentials_never_show(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    options = ServerOptions(
        "http://127.0.0.1:9/v1",
        record_dir=tmp_path,
        record_mirror="memory://creds/run",
        record_mirror_config={"storage_options": {"secret_token": "hunter2"}},
    )
    assert "hunter2" not in repr(options) and "hunter2" not in repr(options.mirror_config)
    with_password = ServerOptions(
        "http://127.0.0.1:9/v1", record_dir=tmp_path, record_mirror="memory://u:hunter2@m/run"
    )
    assert "hunter2" not in repr(with_password)
    mirror = RecordMirror("s3://AKIA:hunter2@bucket/run", MirrorConfig())
    assert mirror.health()["url"] == "s3://AKIA@bucket/run"
    assert "hunter2" not in str(mirror.location("tr_x", ["tr_x.json.zst"]))


def test_the_flags_build_the_mirror(tmp_path: Path) -> None:
    options = from_values(
        {
            "upstream_url": "http://127.0.0.1:9/v1",
            "record_dir": str(tmp_path),
            "record_mirror": "memory://flags/run",
            "record_mirror_config": '{"exclude": ["experts"], "workers": 2}',
        }
    )
    assert options.mirror_config == MirrorConfig(exclude=("experts",), workers=2)
    with pytest.raises(ValueError, match="--record-mirror-config must be a JSON object"):
        from_values(
            {
                "upstream_url": "http://127.0.0.1:9/v1",
                "record_dir": str(tmp_path),
                "record_mirror": "memory://flags/run",
                "record_mirror_config": "[1]",
            }
        )


# -- copies ------------------------------------------------------------------------------------


def test_a_text_capture_is_mirrored_byte_for_byte(make_server, s3: S3, tmp_path: Path) -> None:
    options = mirror_options(s3)
    bucket = options["record_mirror"][5:].partition("/")[0]
    server = make_server(record_dir=tmp_path, **options)
    control = Control(server.url)
    trajectory_id = one_call(control)
    result = control.finish(trajectory_id, annotations={"reward": 1.0}).json()
    record = result["record"]
    assert record["mirror"] == f"{options['record_mirror']}/{trajectory_id}.json.zst"
    assert record["files"] == [f"{trajectory_id}.json.zst"]
    assert record["mirror_state"] in ("pending", "copied") and record["mirror_error"] is None
    assert record["path"] == str(tmp_path / f"{trajectory_id}.json.zst")
    assert settled(control, trajectory_id)["mirror_state"] == "copied"
    local = (tmp_path / f"{trajectory_id}.json.zst").read_bytes()
    assert s3.objects(bucket, "run-7/") == {f"{trajectory_id}.json.zst": local}
    assert counters(control) == {
        "url": options["record_mirror"],
        "mirrored": 1,
        "failed": 0,
        "timed_out": 0,
        "dropped": 0,
        "retried": 0,
        "bytes": len(local),
        "pending": 0,
    }
    # No pinned copies are left behind; readers never see the dot-folder anyway.
    assert not any((tmp_path / ".mirror").iterdir())
    # A repeat finish answers the same location, now with the copy's settled state.
    again = control.finish(trajectory_id).json()["record"]
    assert again["mirror"] == record["mirror"] and again["mirror_state"] == "copied"


def test_a_rewrite_is_mirrored_again_and_wins(make_server, s3: S3, tmp_path: Path) -> None:
    """A finish without a reward writes the record; a later finish adding the reward
    rewrites it, and the mirror ends up holding the rewrite."""
    options = mirror_options(s3)
    bucket = options["record_mirror"][5:].partition("/")[0]
    server = make_server(record_dir=tmp_path, **options)
    control = Control(server.url)
    trajectory_id = one_call(control)
    control.finish(trajectory_id)
    assert settled(control, trajectory_id)["mirror_state"] == "copied"
    first = (tmp_path / f"{trajectory_id}.json.zst").read_bytes()
    result = control.finish(trajectory_id, annotations={"reward": 0.5}).json()
    assert result["status"] == "finished"
    local = (tmp_path / f"{trajectory_id}.json.zst").read_bytes()
    assert local != first
    wait_for(lambda: counters(control)["mirrored"] == 2, 20, "the second copy")
    assert s3.objects(bucket, "run-7/")[f"{trajectory_id}.json.zst"] == local


def test_a_newer_submit_replaces_a_queued_older_one(
    s3: S3, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    bucket = s3.bucket()
    fault_proxy.hold = True
    config = MirrorConfig.from_mapping(
        {"workers": 1, **FAST, "storage_options": s3_options(fault_proxy.endpoint)}
    )
    mirror = RecordMirror(f"s3://{bucket}/r", config)

    def write(trajectory_id: str, content: bytes) -> None:
        (tmp_path / f"{trajectory_id}.json.zst").write_bytes(content)
        mirror.submit(tmp_path, trajectory_id, [f"{trajectory_id}.json.zst"])

    write("tr_a", b"a1")
    wait_for(lambda: fault_proxy.held == 1, 60, "the first copy to reach the store")
    write("tr_a", b"a2")  # tr_a is being copied: a2 waits for it, then goes
    write("tr_b", b"b1")
    write("tr_b", b"b2")  # replaces the queued b1, which is never copied
    assert mirror.health()["pending"] == 3  # tr_a running, tr_a and tr_b queued
    fault_proxy.release()
    assert mirror.wait_idle(20)
    assert s3.objects(bucket, "r/") == {"tr_a.json.zst": b"a2", "tr_b.json.zst": b"b2"}
    health = mirror.health()
    assert (health["mirrored"], health["dropped"], health["pending"]) == (3, 0, 0)
    assert fault_proxy.puts >= 3  # each attempt reached the store (aiohttp may resend once)
    assert mirror.close() == []


def test_remote_copies_run_in_a_child_process_that_may_die(
    s3: S3, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """The copy's client work stays out of the server's process; a copy process killed
    mid-copy costs one retry, and the next put starts a new one."""
    bucket = s3.bucket()
    fault_proxy.hold = True
    config = MirrorConfig.from_mapping(
        {"workers": 1, **FAST, "storage_options": s3_options(fault_proxy.endpoint)}
    )
    mirror = RecordMirror(f"s3://{bucket}/r", config)
    (tmp_path / "tr_a.json.zst").write_bytes(b"a")
    mirror.submit(tmp_path, "tr_a", ["tr_a.json.zst"])
    wait_for(lambda: fault_proxy.held == 1, 60, "the first copy to reach the store")
    child = mirror._copier._process
    assert child is not None and child.pid != os.getpid()
    os.kill(child.pid, signal.SIGKILL)
    fault_proxy.release()
    assert mirror.wait_idle(60)
    assert s3.objects(bucket, "r/") == {"tr_a.json.zst": b"a"}
    health = mirror.health()
    assert (health["mirrored"], health["failed"], health["retried"]) == (1, 0, 1)
    assert mirror._copier._process.pid != child.pid
    assert mirror.close() == []


def test_file_urls_and_memory_urls_are_mirrors_too(tmp_path: Path) -> None:
    target = tmp_path / "remote"
    local = tmp_path / "local"
    local.mkdir()
    (local / "tr_a.tokens.zst").write_bytes(b"tokens")
    (local / "tr_a.json.zst").write_bytes(b"document")
    for url in (target.as_uri(), "memory://skycap-test/run"):
        mirror = RecordMirror(url, MirrorConfig(exclude=("tokens",)))
        mirror.submit(local, "tr_a", ["tr_a.tokens.zst", "tr_a.json.zst"])
        assert mirror.wait_idle(10)
        fs, root = open_store(url)
        assert fs.ls(root, detail=False) == [f"{root}/tr_a.json.zst"]
        assert fs.cat_file(f"{root}/tr_a.json.zst") == b"document"
        assert mirror.location("tr_a", ["tr_a.tokens.zst", "tr_a.json.zst"])["mirror_state"] == (
            "excluded"
        )


def test_a_record_replayed_from_a_crash_journal_is_mirrored(make_server, tmp_path: Path) -> None:
    (tmp_path / "records").mkdir()
    journal = Journal(tmp_path / "records")  # what a killed server leaves behind
    journal.open(Trajectory("tr_00000000000000dd", capture={"mode": "text"}))
    journal.close()
    remote = tmp_path / "remote"
    server = make_server(record_dir=tmp_path / "records", record_mirror=remote.as_uri())
    with Control(server.url) as control:
        assert settled(control, "tr_00000000000000dd")["mirror_state"] == "copied"
    assert (remote / "tr_00000000000000dd.json.zst").read_bytes() == (
        tmp_path / "records" / "tr_00000000000000dd.json.zst"
    ).read_bytes()


# -- faults ------------------------------------------------------------------------------------


def test_the_store_down_fails_open(make_server, s3: S3, fault_proxy: FaultProxy, tmp_path: Path):
    fault_proxy.reset = True
    options = mirror_options(s3, fault_proxy.endpoint, attempts=3)
    server = make_server(record_dir=tmp_path, **options)
    control = Control(server.url)
    trajectory_id = one_call(control)
    started = time.perf_counter()
    result = control.finish(trajectory_id, annotations={"reward": 1})
    assert result.status_code == 200 and result.json()["status"] == "finished"
    state = settled(control, trajectory_id)
    assert state["mirror_state"] == "failed"
    assert "json.zst" in state["mirror_error"]
    assert (tmp_path / f"{trajectory_id}.json.zst").is_file()
    assert counters(control)["failed"] == 1 and counters(control)["retried"] == 2
    assert fault_proxy.puts >= 3  # each attempt reached the store (aiohttp may resend once)
    fault_proxy.reset = False
    serving(control)
    assert time.perf_counter() - started < 60  # bounded: three tries, not a hang


def test_500s_then_recovery_are_retried(make_server, s3: S3, fault_proxy: FaultProxy, tmp_path):
    fault_proxy.fail, fault_proxy.fail_count = 500, 2
    options = mirror_options(s3, fault_proxy.endpoint, attempts=3)
    bucket = options["record_mirror"][5:].partition("/")[0]
    server = make_server(record_dir=tmp_path, **options)
    control = Control(server.url)
    trajectory_id = one_call(control)
    control.finish(trajectory_id)
    assert settled(control, trajectory_id)["mirror_state"] == "copied"
    local = (tmp_path / f"{trajectory_id}.json.zst").read_bytes()
    assert s3.objects(bucket, "run-7/") == {f"{trajectory_id}.json.zst": local}
    health = counters(control)
    assert (health["mirrored"], health["retried"], health["failed"]) == (1, 2, 0)


def test_access_denied_is_not_retried(make_server, s3: S3, fault_proxy: FaultProxy, tmp_path):
    fault_proxy.fail, fault_proxy.fail_count = 403, 100
    options = mirror_options(s3, fault_proxy.endpoint, attempts=3)
    server = make_server(record_dir=tmp_path, **options)
    control = Control(server.url)
    trajectory_id = one_call(control)
    control.finish(trajectory_id)
    state = settled(control, trajectory_id)
    assert state["mirror_state"] == "failed" and "PermissionError" in state["mirror_error"]
    health = counters(control)
    assert (health["failed"], health["retried"], fault_proxy.puts) == (1, 0, 1)
    assert (tmp_path / f"{trajectory_id}.json.zst").is_file()
    serving(control)


def test_a_copy_slower_than_timeout_is_abandoned(
    make_server, s3: S3, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    fault_proxy.hold = True
    options = mirror_options(s3, fault_proxy.endpoint, timeout=0.3)
    server = make_server(record_dir=tmp_path, **options)
    control = Control(server.url)
    trajectory_id = one_call(control)
    finish = control.finish(trajectory_id)
    assert finish.status_code == 200 and finish.elapsed.total_seconds() < 0.3
    state = settled(control, trajectory_id)
    assert state["mirror_state"] == "failed" and "timed out after 0.3 s" in state["mirror_error"]
    health = counters(control)
    assert (health["timed_out"], health["failed"], health["retried"]) == (1, 1, 0)
    fault_proxy.release()
    serving(control)


def test_a_full_queue_drops_with_a_counter(
    make_server, s3: S3, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    fault_proxy.hold = True
    options = mirror_options(s3, fault_proxy.endpoint, workers=1, queue_size=1)
    server = make_server(record_dir=tmp_path, **options)
    control = Control(server.url)
    first, second, third = (one_call(control) for _ in range(3))
    control.finish(first)
    wait_for(lambda: fault_proxy.held == 1, 60, "the first copy to reach the store")
    control.finish(second)  # queued behind the first
    dropped = control.finish(third).json()["record"]
    assert dropped["mirror_state"] == "failed"
    assert "copy queue is full (1 records queued)" in dropped["mirror_error"]
    assert counters(control)["dropped"] == 1 and counters(control)["pending"] == 2
    fault_proxy.release()
    assert settled(control, second)["mirror_state"] == "copied"
    assert counters(control)["mirrored"] == 2
    for trajectory_id in (first, second, third):
        assert (tmp_path / f"{trajectory_id}.json.zst").is_file()
    serving(control)


def test_shutdown_waits_at_most_shutdown_timeout(
    make_server, s3: S3, fault_proxy: FaultProxy, tmp_path: Path, caplog
) -> None:
    fault_proxy.hold = True
    options = mirror_options(s3, fault_proxy.endpoint, workers=1, shutdown_timeout=0.5)
    server = make_server(record_dir=tmp_path, **options)
    control = Control(server.url)
    finished = one_call(control)
    control.finish(finished)
    wait_for(lambda: fault_proxy.held == 1, 60, "the first copy to reach the store")
    still_open = one_call(control)  # written at shutdown, queued behind the held copy
    mirror = server.store.records.mirror
    caplog.set_level(logging.WARNING, logger="skycap.mirror")
    started = time.perf_counter()
    server.stop()
    assert time.perf_counter() - started < 5
    assert (tmp_path / f"{finished}.json.zst").is_file()
    assert (tmp_path / f"{still_open}.json.zst").is_file()
    health = mirror.health()
    assert (health["dropped"], health["mirrored"]) == (1, 0)
    warning = next(r.getMessage() for r in caplog.records if "record(s)" in r.getMessage())
    assert "2 record(s) not copied" in warning
    assert finished in warning and still_open in warning
    fault_proxy.release()


async def test_the_pool_reports_where_a_record_is(make_server, s3: S3, tmp_path: Path) -> None:
    import asyncio

    from skycap import CapturePool

    options = mirror_options(s3)
    server = make_server(record_dir=tmp_path, **options)
    async with CapturePool([server.url]) as pool:
        trajectory = await pool.create({"task": "t"})
        client = openai.AsyncOpenAI(
            base_url=trajectory.base_url, api_key=trajectory.api_key, max_retries=0
        )
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )
        result = await trajectory.finish({"reward": 1.0})
        assert result.record is not None
        assert result.record.mirror == f"{options['record_mirror']}/{trajectory.id}.json.zst"
        assert result.record.mirror_state in ("pending", "copied")
        deadline = time.monotonic() + 20
        while (location := await trajectory.record()).mirror_state == "pending":
            assert time.monotonic() < deadline, "the copy did not settle"
            await asyncio.sleep(0.01)
        assert location.mirror_state == "copied" and location.mirror_error is None
        assert location.uri == result.record.mirror


def test_skycap_serve_refuses_a_mirror_it_cannot_use(tmp_path: Path, capsys) -> None:
    from skycap.cli.main import main as skycap_main

    base = ["serve", "--upstream-url", "http://127.0.0.1:9/v1", "--port", "0"]
    with pytest.raises(SystemExit) as exited:
        skycap_main([*base, "--record-dir", str(tmp_path), "--record-mirror", "gs://b/p"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "skycap[remote]" in err and "uv sync --extra remote" in err
    with pytest.raises(SystemExit):
        skycap_main([*base, "--no-record-dir", "--record-mirror", "memory://m"])
    assert "--record-dir" in capsys.readouterr().err

"""A record that cannot be written is an error: healthz 503, an error line, retries, exit 3."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import errno
import logging
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import Control, make_server, stderr_to_exit, upstream, wait_for
from test_durability import ServeProcess

from skycap import RecordsLost
from skycap.logqueue import flush_log_queue
from skycap.record import writer


class SmallDisk:
    """A record directory that can be made full and freed again.

    A 1 MiB tmpfs when this process may mount one (the real ENOSPC path); otherwise the
    record writer is made to fail with ENOSPC, as a full disk would.
    """

    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = path
        path.mkdir()
        try:
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True
            )
        except OSError:  # no mount command at all
            mounted = None
        self.tmpfs = mounted is not None and mounted.returncode == 0
        self.full = False
        if not self.tmpfs:
            real = writer._write_file

            def write_file(*args, **kwargs):
                if self.full:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real(*args, **kwargs)

            monkeypatch.setattr(writer, "_write_file", write_file)

    def fill(self) -> None:
        self.full = True
        if self.tmpfs:
            with open(self.dir / "filler", "ab", buffering=0) as filler:
                try:
                    while True:
                        filler.write(bytes(4096))
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC

    def free(self) -> None:
        self.full = False
        (self.dir / "filler").unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.dir)], check=False)


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallDisk]:
    small = SmallDisk(tmp_path / "disk", monkeypatch)
    yield small
    small.unmount()


def _call(created: dict) -> None:
    response = httpx.post(
        f"{created['base_url']}/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "hello"}]},
        timeout=20,
    )
    assert response.status_code == 200, response.text


def test_a_full_disk_is_an_error_retried_until_written(
    make_server, disk: SmallDisk, caplog: pytest.LogCaptureFixture
):
    server = make_server(record_dir=disk.dir, sweep_interval=0.05)
    with Control(server.url) as control:
        created = control.create()
        _call(created)
        disk.fill()
        with caplog.at_level(logging.ERROR, logger="skycap.server"):
            finished = control.finish(created["id"])
        assert finished.status_code == 200 and finished.json()["record"] is None
        health = control.http.get("/healthz")
        assert health.status_code == 503
        assert health.json()["ok"] is False
        assert health.json()["unwritten_records"] == [created["id"]]
        assert flush_log_queue()  # the server's log lines reach caplog from the writer thread
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        path = str(disk.dir / f"{created['id']}.json.zst")
        assert any(created["id"] in m and path in m for m in errors), errors
        # Retried while the process runs: once there is room, it is written.
        disk.free()
        wait_for(lambda: control.http.get("/healthz").status_code == 200, 10, "a retry")
        assert (disk.dir / f"{created['id']}.json.zst").is_file()
        assert control.document(created["id"]).json()["status"] == "finished"

        # At stop, a record that still cannot be written raises RecordsLost naming it.
        lost = control.create()
        _call(lost)
        disk.fill()
    with pytest.raises(RecordsLost) as raised:
        server.stop()
    assert raised.value.ids == [lost["id"]]
    assert lost["id"] in str(raised.value)
    # Its crash journal stayed: the next server on this directory writes it.
    disk.free()
    again = make_server(record_dir=disk.dir)
    with Control(again.url) as control:
        document = control.document(lost["id"]).json()
        assert document["status"] == "open" and len(document["nodes"]) == 2


def test_serve_exits_3_when_records_are_lost(upstream, disk: SmallDisk):
    if not disk.tmpfs:
        pytest.skip("needs a tmpfs (mount) to fill a disk under another process")
    serve = ServeProcess("--upstream-url", upstream.base_url, "--record-dir", str(disk.dir))
    try:
        with Control(serve.url, serve.token) as control:
            created = control.create()
            _call(created)
            disk.fill()
        serve.process.send_signal(signal.SIGTERM)
        stderr = stderr_to_exit(serve.process, timeout=60)
    finally:
        if serve.process.poll() is None:
            serve.process.kill()
    assert serve.process.returncode == 3, stderr
    assert "Traceback" not in stderr
    assert f"records cannot be written to {disk.dir}" in stderr
    assert f"{disk.dir}/{created['id']}.json.zst" in stderr
    assert f"1 records could not be written to {disk.dir}: {created['id']}" in stderr

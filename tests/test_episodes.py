"""One cause failing many trajectories is a few log lines (start, summaries, end) and counters."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from server_fixtures import Control, make_server, upstream, wait_for
from test_unwritable import SmallDisk, _call, disk

from skycap.episodes import FailureEpisode
from skycap.logqueue import flush_log_queue


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture
def lines() -> Lines:
    return Lines()


def episode(lines: Lines, clock: Clock) -> FailureEpisode:
    logger = logging.getLogger("test.episodes")
    logger.handlers[:] = [lines]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return FailureEpisode(logger, "records cannot be written to /d", every=10.0, clock=clock)


def test_a_start_summaries_at_most_every_n_seconds_and_an_end(lines: Lines) -> None:
    clock = Clock()
    disk_full = episode(lines, clock)
    ids = [f"tr_{i:016x}" for i in range(256)]
    for second in range(30):  # every trajectory fails, and is retried, for 30 s
        clock.now = 100.0 + second
        for trajectory_id in ids:
            disk_full.failed(trajectory_id, "No space left on device")
    assert len(lines.records) == 3  # the start, then summaries at 10 s and 20 s
    start, summary = lines.messages[0], lines.messages[1]
    assert lines.records[0].levelno == logging.ERROR
    assert "No space left on device" in start and ids[0] in start
    assert "256 trajectories" in summary and "and 251 more" in summary
    assert all(i in summary for i in ids[:5]) and ids[5] not in summary
    health = disk_full.health()
    assert health["failing"] and health["trajectories"] == 256 and health["failing_now"] == 256
    assert health["failures_total"] == 256 * 30 and health["episodes_total"] == 1

    for trajectory_id in ids[:-1]:  # written one by one: the last one ends the episode
        disk_full.succeeded(trajectory_id)
    assert len(lines.records) == 3
    clock.now = 135.0
    disk_full.succeeded(ids[-1])
    assert len(lines.records) == 4
    end = lines.messages[3]
    assert "recovered after 35.0 s" in end and f"{256 * 30} failures" in end
    assert f"{256 * 29} retries" in end
    assert disk_full.health()["failing"] is False and disk_full.health()["since_s"] is None

    disk_full.failed(ids[0], "again")  # a new episode starts with its own line
    assert len(lines.records) == 5 and disk_full.health()["episodes_total"] == 2
    disk_full.succeeded()  # the cause works again for every trajectory
    assert len(lines.records) == 6 and not disk_full.active


def test_a_full_disk_under_many_trajectories_is_a_few_lines(
    make_server, disk: SmallDisk, caplog: pytest.LogCaptureFixture
) -> None:
    """24 trajectories whose records fail, retried every 50 ms: bounded lines, not 24 each."""
    server = make_server(record_dir=disk.dir, sweep_interval=0.05)
    with Control(server.url) as control:
        created = [control.create() for _ in range(24)]
        for one in created:
            _call(one)
        disk.fill()
        with caplog.at_level(logging.INFO, logger="skycap"):  # as `--log-level info`
            for one in created:
                assert control.finish(one["id"]).status_code == 200
            health = control.http.get("/healthz").json()
            record_write = health["failing_causes"]["record_write"]
            assert record_write["failing"] and record_write["trajectories"] == 24
            wait_for(
                lambda: (
                    control.http.get("/healthz").json()["failing_causes"]["record_write"][
                        "failures_total"
                    ]
                    >= 3 * 24
                ),
                20,
                "the retries",
            )
            disk.free()
            wait_for(lambda: control.http.get("/healthz").status_code == 200, 20, "the writes")
            assert flush_log_queue()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert 2 <= len(said) <= 6, said
    assert "records cannot be written" in said[0] and "recovered after" in said[-1]
    assert "24 trajectories" in said[-1]
    assert all((disk.dir / f"{one['id']}.json.zst").is_file() for one in created)


def test_healthz_counts_each_cause(make_server, tmp_path: Path) -> None:
    server = make_server(record_dir=tmp_path)
    with Control(server.url) as control:
        causes = control.http.get("/healthz").json()["failing_causes"]
    assert set(causes) == {"record_write", "journal_write", "upstream_connect"}
    assert causes["upstream_connect"] == {
        "failing": False,
        "since_s": None,
        "trajectories": 0,
        "failing_now": 0,
        "episodes_total": 0,
        "failures_total": 0,
        "last_error": None,
    }

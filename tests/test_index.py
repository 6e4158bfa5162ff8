"""skycap.index with the real wandb library offline and a real S3 (moto): one artifact version
per step with a reference entry per mirrored file, step.json beside the
records and in the mirror, and the background worker failing open through a seam at
`log_artifact` (raises, hangs, accepted-then-failed, a full queue, close's deadline)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mirror_fixtures import S3, s3_options
from rollout_agents import client_for, episode
from server_fixtures import ServerThread, wait_for
from wandb_offline import logged_artifacts

from skycap import CapturePool
from skycap.client import RecordLocation
from skycap.index import IndexConfig, RecordIndex, artifact_name
from skycap.record.mirror import open_store
from skycap.rollout import AttemptRecord, RecordLog, Rollout, RolloutRunner

SAMPLING = {"temperature": 0.8, "max_tokens": 256}


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """`start(name)` -> a real offline wandb run in a temporary WANDB_DIR (finished after)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    runs: list[Any] = []

    def start(name: str = "run-7") -> Any:
        run = wandb.init(project="skycap-test", name=name, settings=wandb.Settings(console="off"))
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.finish()


def written_artifacts(run: Any, count: int) -> list[dict[str, Any]]:
    """The artifact records of a finished offline run's `.wandb` file, once `count` are
    there (wandb-core may still be writing the file when finish returns on a loaded
    machine)."""
    folder = Path(run.dir).parent
    return wait_for(
        lambda: (found := logged_artifacts(folder)) and len(found) >= count and found,
        30.0,
        f"{count} artifact records in {folder}",
    )


def capture_artifacts(run: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, list[str]]]:
    """Every (Artifact, aliases) the index hands the run, passed on to the real log_artifact."""
    seen: list[tuple[Any, list[str]]] = []
    real = run.log_artifact

    def log_artifact(artifact: Any, aliases: list[str] | None = None, **kw: Any) -> Any:
        seen.append((artifact, list(aliases or [])))
        return real(artifact, aliases=aliases, **kw)

    monkeypatch.setattr(run, "log_artifact", log_artifact)
    return seen


# -- against a token-mode capture server mirroring to moto -------------------------------------


class Agent(RolloutRunner):
    """The tool-using agent; the first attempt of instance "flaky" raises, "hang" never ends."""

    def __init__(self, pool: CapturePool, **kw: Any) -> None:
        super().__init__(pool, **kw)
        self.flaky_failed = False
        self.hanging = 0

    async def run_rollout(
        self, prompt: Any, *, base_url: str, api_key: str, sampling: dict[str, Any], env: Any
    ) -> Rollout:
        client = client_for(base_url, api_key)
        try:
            answer, turns = await episode(client, prompt["question"], sampling)
            if prompt["instance_id"] == "flaky" and not self.flaky_failed:
                self.flaky_failed = True
                raise RuntimeError("the sandbox died")
            if prompt["instance_id"] == "hang":
                self.hanging += 1
                await asyncio.Event().wait()
            return Rollout(1.0 if answer.startswith("Done") else 0.0, annotations={"turns": turns})
        finally:
            await client.close()


def prompt(instance_id: str) -> dict[str, Any]:
    return {"instance_id": instance_id, "question": f"What does note {instance_id} say?"}


@pytest.fixture
def mirrored_server(
    token_server_options: Callable[..., Any], s3: S3, tmp_path: Path
) -> Iterator[tuple[ServerThread, str, dict[str, Any]]]:
    bucket = s3.bucket()
    url = f"s3://{bucket}/run-7"
    storage = s3_options(s3.endpoint)
    options = token_server_options(
        record_dir=tmp_path / "records",
        record_mirror=url,
        record_mirror_config={"backoff": 0.01, "storage_options": storage},
    )
    server = ServerThread(options)
    server.start()
    yield server, url, storage
    server.stop()


def test_each_step_is_one_version_with_a_reference_per_mirrored_file(
    mirrored_server: tuple[ServerThread, str, dict[str, Any]],
    s3: S3,
    offline: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, url, storage = mirrored_server
    records = tmp_path / "records"
    run = offline()
    handed = capture_artifacts(run, monkeypatch)

    async def loop() -> tuple[Agent, list[Any], list[Any]]:
        async with CapturePool([server.url]) as pool:
            agent = Agent(pool, attempts=2)
            # Step 3 takes two generate calls (dynamic sampling): one version all the same.
            first = await agent.generate([prompt("a"), prompt("flaky")], repeats=2, step=3)
            second = await agent.generate([prompt("b")], repeats=1, step=3)
            await agent.generate([prompt("e")], repeats=1, step=3, phase="eval")
            # Step 4: a batch dropped unfinished (cancelled), then the one the trainer used.
            dropped = asyncio.ensure_future(agent.generate([prompt("hang")], step=4))
            await asyncio.to_thread(wait_for, lambda: agent.hanging, 20.0, "the hanging rollout")
            dropped.cancel()
            with pytest.raises(asyncio.CancelledError):
                await dropped
            fourth = await agent.generate([prompt("c")], repeats=2, step=4)
            return agent, first + second, fourth

    agent, step3, step4 = asyncio.run(loop())
    log = agent.record_log
    dropped_ids = [e.id for e in log.entries("train", 4) if e.dropped]
    assert len(dropped_ids) == 1
    every = [e for e in log.entries() if e.id and not e.dropped]
    bucket = url[5:].partition("/")[0]
    wait_for(
        lambda: (
            len([k for k in s3.objects(bucket, "run-7/") if k.endswith(".json.zst")]) >= len(every)
        ),
        30.0,
        "every record in the mirror",
    )

    index = RecordIndex(run, record_dir=records, mirror=url, storage_options=storage)
    trained3 = {r.trajectory_id for r in step3 if r.ok} - {step3[0].trajectory_id}
    superseded = [e.id for e in log.entries("train", 3) if e.superseded]
    assert len(superseded) == 1
    document3 = index.log_step(3, "train", trained3 | set(superseded), log)
    assert index.log_step(3, "eval", None, log) is None  # eval is off by default
    document4 = index.log_step(4, "train", {r.trajectory_id for r in step4}, log)
    assert index.close(timeout=60) == []
    assert len(log) == 0  # indexed, skipped and dropped attempts all left the log

    rows3 = {row["id"]: row for row in document3["rows"]}
    assert len(rows3) == 6  # 2 + 2 repetitions + 1 retry + 1 from the second generate call
    for row_id in superseded:
        assert rows3[row_id]["superseded"] is True and rows3[row_id]["trained"] is False
    assert rows3[step3[0].trajectory_id]["trained"] is False
    assert sum(row["trained"] for row in rows3.values()) == len(trained3)
    assert {row["attempt"] for row in rows3.values()} == {0, 1}
    assert [row["id"] for row in document4["rows"]] == [r.trajectory_id for r in step4]
    assert not set(dropped_ids) & set(rows3) and dropped_ids[0] not in json.dumps(document4)

    # One version per step, named and aliased as documented; eval not logged at all.
    assert [a.name for a, _ in handed] == [artifact_name("train", run.id)] * 2
    assert [aliases for _, aliases in handed] == [
        ["train-step-3", "latest"],
        ["train-step-4", "latest"],
    ]
    for (artifact, _), document, step in ((handed[0], document3, 3), (handed[1], document4, 4)):
        entries = artifact.manifest.entries
        local = (records / "index" / "train" / f"step-{step}.json").read_bytes()
        assert Path(entries["step.json"].local_path).read_bytes() == local
        assert json.loads(local) == document
        mirrored = open_store(url, storage)[0].cat_file(
            f"{bucket}/run-7/index/train/step-{step}.json"
        )
        assert mirrored == local
        files = [f for row in document["rows"] for f in row["record"]["files"]]
        assert len(files) > len(document["rows"])  # token mode: sidecars too
        assert sorted(entries) == sorted(["step.json"] + [f"records/{f}" for f in files])
        for name in files:
            assert entries[f"records/{name}"].ref == f"{url}/{name}"
    assert artifact.metadata["rows"] == 2 and artifact.metadata["step"] == 4

    # Each reference names the object in the mirror holding exactly the local record's bytes.
    for artifact, _ in handed:
        for entry_name, entry in artifact.manifest.entries.items():
            if entry_name.startswith("records/"):
                bucket_name, _, key = entry.ref.removeprefix("s3://").partition("/")
                fetched = s3.client.get_object(Bucket=bucket_name, Key=key)["Body"].read()
                assert fetched == (records / entry_name.removeprefix("records/")).read_bytes()

    run.finish()
    written = written_artifacts(run, len(handed))
    assert [(a["name"], a["type"], a["aliases"]) for a in written] == [
        (artifact_name("train", run.id), "skycap-records", sorted(aliases)) for _, aliases in handed
    ]
    for record, (artifact, _) in zip(written, handed, strict=True):
        assert record["entries"] == {p: e.ref or "" for p, e in artifact.manifest.entries.items()}
        assert json.loads(record["metadata"]) == artifact.metadata


# -- hand-built record logs ---------------------------------------------------------------------


def attempt(
    log: RecordLog,
    trajectory_id: str,
    *,
    phase: str = "train",
    step: int = 1,
    instance: str = "0",
    repetition: int = 0,
    number: int = 0,
    record: RecordLocation | None = None,
    **fields: Any,
) -> AttemptRecord:
    values: dict[str, Any] = {
        "status": "finished",
        "annotations": {"reward": 1.0, "stop_reason": "complete"},
        "record": record or RecordLocation(path=f"/data/{trajectory_id}.json.zst", host="10.0.0.5"),
        **fields,
    }
    entry = AttemptRecord(
        phase=phase,
        step=step,
        instance_id=instance,
        repetition_id=repetition,
        attempt=number,
        prompt_index=0,
        meta={},
        id=trajectory_id,
        **values,
    )
    return log.open(entry)


def test_eval_goes_to_its_own_artifact_when_enabled_and_local_records_stay_in_step_json(
    offline: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = offline("eval-run")
    handed = capture_artifacts(run, monkeypatch)
    index = RecordIndex(run, phases=("train", "eval"), record_dir=tmp_path)
    log = RecordLog()
    attempt(log, "tr_local", phase="eval", step=5)
    attempt(
        log,
        "tr_failed_copy",
        phase="eval",
        step=5,
        instance="1",
        record=RecordLocation(
            path="/data/tr_failed_copy.json.zst",
            mirror="s3://b/run/tr_failed_copy.json.zst",
            files=("tr_failed_copy.json.zst",),
            mirror_state="failed",
            mirror_error="AccessDenied",
        ),
    )
    attempt(log, "tr_train", step=5)
    document = index.log_step(5, "eval", {"tr_local"}, log)
    assert [row["trained"] for row in document["rows"]] == [False, False]  # never in eval
    untrained = index.log_step(5, "train", None, log)
    assert untrained["rows"][0]["trained"] is None  # the trainer did not say
    assert index.close() == []
    assert [(a.name, aliases) for a, aliases in handed] == [
        (artifact_name("eval", run.id), ["eval-step-5", "latest"]),
        (artifact_name("train", run.id), ["train-step-5", "latest"]),
    ]
    # Neither a local-only record nor one whose copy failed is a reference: step.json only.
    assert sorted(handed[0][0].manifest.entries) == ["step.json"]
    assert json.loads((tmp_path / "index" / "eval" / "step-5.json").read_bytes()) == document
    assert document["rows"][1]["record"]["mirror_state"] == "failed"
    run.finish()
    assert [a["aliases"] for a in written_artifacts(run, 2)] == [
        ["eval-step-5", "latest"],
        ["latest", "train-step-5"],
    ]


def test_without_w_and_b_a_run_is_indexed_in_files(tmp_path: Path) -> None:
    log = RecordLog()
    attempt(log, "tr_dropped", dropped=True)
    attempt(log, "tr_old_drop", step=0, dropped=True)
    attempt(log, "tr_kept", step=2)  # generated ahead for the next step: left in the log
    attempt(log, "tr_a", instance="a", number=0, superseded=True)
    attempt(log, "tr_b", instance="a", number=1)
    with RecordIndex("run-7", record_dir=tmp_path, mirror="memory://index-test/run-7") as index:
        document = index.log_step(1, "train", ["tr_a", "tr_b"], log)
        with pytest.raises(ValueError, match="train step 1 is already indexed"):
            index.log_step(1, "train", [], log)
    assert [e.id for e in log.entries()] == ["tr_kept"]
    assert document["run"] == "run-7" and document["format_version"] == 1
    assert [(r["id"], r["superseded"], r["trained"]) for r in document["rows"]] == [
        ("tr_a", True, False),
        ("tr_b", False, True),
    ]
    local = (tmp_path / "index" / "train" / "step-1.json").read_bytes()
    fs, root = open_store("memory://index-test/run-7")
    assert fs.cat_file(f"{root}/index/train/step-1.json") == local
    stats = index.stats()
    assert stats["steps"] == 1 and stats["rows"] == 2 and stats["discarded"] == 2
    assert stats["mirror"]["logged"] == 1 and stats["local"] == {"written": 1, "failed": 0}


# -- the seam at log_artifact: a stand-in run whose log_artifact misbehaves on demand ----------


class SeamRun:
    """A wandb run reduced to what the index calls; `behave(n, artifact)` runs in log_artifact."""

    offline = False

    def __init__(self, behave: Callable[[int, Any], Any]) -> None:
        self.id = "seam1234"
        self.name = "seam-run"
        self.behave = behave
        self.calls: list[tuple[int, list[str]]] = []
        self.lock = threading.Lock()

    def log_artifact(self, artifact: Any, aliases: list[str] | None = None) -> Any:
        with self.lock:
            number = len(self.calls)
            self.calls.append((artifact.metadata["step"], list(aliases or [])))
        return self.behave(number, artifact)


class Logged:
    """What log_artifact returns: `wait` succeeds or raises."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.waited = 0

    def wait(self, timeout: float | None = None) -> Logged:
        self.waited += 1
        if self.error is not None:
            raise self.error
        return self


FAST = IndexConfig(timeout=5.0, attempts=3, backoff=0.01, queue_size=4, close_timeout=10.0)


def steps(index: RecordIndex, numbers: range) -> None:
    for number in numbers:
        log = RecordLog()
        attempt(log, f"tr_{number}", step=number)
        index.log_step(number, "train", None, log)


def test_transient_errors_are_retried_and_others_are_not() -> None:
    from wandb.errors import CommError

    def behave(n: int, artifact: Any) -> Any:
        step = artifact.metadata["step"]
        if step == 0 and n < 2:
            raise CommError("502 Bad Gateway")
        if step == 1:
            raise ValueError("artifact name is invalid")
        return Logged()

    run = SeamRun(behave)
    index = RecordIndex(run, config=FAST)
    steps(index, range(2))
    assert index.close() == []
    assert [step for step, _ in run.calls] == [0, 0, 0, 1]  # the ValueError is tried once
    stats = index.stats()["wandb"]
    assert stats == {
        "logged": 1,
        "failed": 1,
        "timed_out": 0,
        "dropped": 0,
        "retried": 2,
        "pending": 0,
    }


def test_a_version_w_and_b_accepted_is_never_logged_again() -> None:
    answers = [Logged(ConnectionError("reset while committing")), Logged()]
    run = SeamRun(lambda n, artifact: answers[n])
    index = RecordIndex(run, config=FAST)
    steps(index, range(2))
    assert index.close() == []
    assert [step for step, _ in run.calls] == [0, 1]  # step 0 failed after acceptance: once
    assert answers[0].waited == 1
    stats = index.stats()["wandb"]
    assert stats["failed"] == 1 and stats["logged"] == 1 and stats["retried"] == 0


def test_a_hanging_call_is_abandoned_at_the_timeout_and_the_next_step_goes_on() -> None:
    release = threading.Event()

    def behave(n: int, artifact: Any) -> Any:
        if artifact.metadata["step"] == 0:
            release.wait(30)
        return Logged()

    run = SeamRun(behave)
    index = RecordIndex(run, config=IndexConfig(timeout=2.0, backoff=0.01))
    try:
        steps(index, range(2))
        wait_for(lambda: index.stats()["wandb"]["logged"] == 1, 20.0, "step 1 logged")
        assert index.close() == []
    finally:
        release.set()
    assert [step for step, _ in run.calls] == [0, 1]  # abandoned, not retried
    assert index.stats()["wandb"]["timed_out"] == 1


def test_a_full_queue_drops_and_close_keeps_its_deadline(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    run = SeamRun(lambda n, artifact: release.wait(30) and Logged())
    index = RecordIndex(run, config=IndexConfig(queue_size=2, timeout=60.0))
    try:
        steps(index, range(1))
        wait_for(lambda: run.calls, 20.0, "the first version to start")
        steps(index, range(1, 5))  # two queue behind the first; two are dropped
        assert index.stats()["wandb"]["dropped"] == 2
        started = time.monotonic()
        left = index.close(timeout=0.3)
        assert time.monotonic() - started < 5.0
        assert left == ["W&B train step 1", "W&B train step 2", "W&B train step 0"]
    finally:
        release.set()
    assert index.stats()["wandb"]["dropped"] == 4
    assert "not logged by close" in caplog.text
    with pytest.raises(RuntimeError, match="closed"):
        steps(index, range(9, 10))


def test_a_bug_in_the_index_code_raises_into_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    run = SeamRun(lambda n, artifact: Logged())
    index = RecordIndex(run, config=FAST)
    log = RecordLog()
    attempt(log, "tr_x", annotations={"reward": {1, 2}})  # not JSON: the caller's problem
    with pytest.raises(TypeError, match="not JSON serializable: set"):
        index.log_step(1, "train", None, log)

    def broken(rows: list[dict[str, Any]]) -> Any:
        raise KeyError("files")

    monkeypatch.setattr("skycap.index._references", broken)
    attempt(log, "tr_y", step=2)
    with pytest.raises(KeyError, match="files"):
        index.log_step(2, "train", None, log)
    with pytest.raises(TypeError, match="RecordLog"):
        index.log_step(3, "train", None, [])
    with pytest.raises(TypeError, match="not one string"):
        index.log_step(3, "train", "tr_y", log)
    with pytest.raises(ValueError, match="phase must be letters"):
        RecordIndex(run, phases=("train/x",))
    assert index.close() == [] and run.calls == []


# -- skycap view reads the index ----------------------------------------------------------------


def indexed_rows(url: str, run: str) -> dict[str, Any]:
    import httpx

    response = httpx.get(f"{url.rstrip('/')}/api/v1/runs/{run}/trajectories", timeout=10)
    assert response.status_code == 200, response.text
    return {row["id"]: row["indexed"] for row in response.json()["rows"]}


def test_the_viewer_shows_trained_and_superseded_from_the_index(tmp_path: Path) -> None:
    import shutil

    from test_viewer_fixtures import grpo_id, write_grpo

    from skycap.record.remote import MirrorCache
    from skycap.viewer.server import make_server

    records = tmp_path / "grpo"
    records.mkdir()
    write_grpo(records)
    mirror = tmp_path / "mirror"
    shutil.copytree(records, mirror)
    log = RecordLog()
    retried, counting = grpo_id(2, "a", 0, 0), grpo_id(2, "a", 0, 1)
    untrained = grpo_id(2, "a", 1, 0)
    attempt(log, retried, step=2, instance="a", superseded=True)
    attempt(log, counting, step=2, instance="a", number=1)
    attempt(log, untrained, step=2, instance="a", repetition=1)
    with RecordIndex("grpo-run", record_dir=records, mirror=f"file://{mirror}") as index:
        index.log_step(2, "train", {retried, counting}, log)

    cache = MirrorCache(f"file://{mirror}", cache_dir=tmp_path / "cache")
    server = make_server([records], port=0, mirrors=[cache])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        for run in ("grpo", "mirror"):  # the local directory, and the mirror through its cache
            rows = indexed_rows(server.url, run)
            where = {"phase": "train", "step": 2}
            assert rows[retried] == {**where, "trained": False, "superseded": True}
            assert rows[counting] == {**where, "trained": True, "superseded": False}
            assert rows[untrained] == {**where, "trained": False, "superseded": False}
            assert rows[grpo_id(1, "a", 0, 0)] is None  # step 1 has no index: nothing shown
        # A step indexed later shows at the next rescan.
        log = RecordLog()
        attempt(log, grpo_id(1, "a", 0, 0), step=1, instance="a")
        with RecordIndex("grpo-run", record_dir=records) as index:
            index.log_step(1, "train", None, log)
        wait_for(
            lambda: indexed_rows(server.url, "grpo")[grpo_id(1, "a", 0, 0)] is not None,
            20.0,
            "the new index file to show",
        )
        assert indexed_rows(server.url, "grpo")[grpo_id(1, "a", 0, 0)]["trained"] is None
    finally:
        server.shutdown()
        server.server_close()

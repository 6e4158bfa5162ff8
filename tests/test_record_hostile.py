"""Hostile record files: each is a record error naming its file; the rest of the directory reads."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_record import TR_ID, worked_example
from test_record_integrity import _hostile_frame

from skycap.loader import load
from skycap.record.reader import RecordError, load_trajectory
from skycap.record.writer import write_record
from skycap.viewer.server import make_server
from skycap.viewer.validate import check_document

KINDS = ("tokens", "experts", "sampling_mask")


def _nested(depth: int) -> dict:
    value: dict = {"text": "bottom"}
    for _ in range(depth):
        value = {"inner": value}
    return value


def _deep_message(d: dict) -> None:
    d["nodes"][0]["message"] = {"role": "user", "content": [_nested(300)]}


def _no_text_array(d: dict) -> None:
    del d["sidecars"]["tokens"]["arrays"]["text"]


def _text_parts(d: dict) -> None:
    d["nodes"][0]["message"] = {"role": "user", "content": [{"type": "text"}, 7, None]}


HOSTILE: dict[str, Callable[[dict], None]] = {
    "message_null": lambda d: d["nodes"][0].update(message=None),
    "samples_list": lambda d: d.update(samples=[1, 2]),
    "samples_rows": lambda d: d.update(samples={"paths": "all", "rows": [{"leaf": 99}]}),
    "huge_shape": lambda d: d["sidecars"]["experts"]["arrays"]["routed_experts"].update(
        shape=[2**62, 4, 2]
    ),
    "no_text_array": _no_text_array,
    "text_parts": _text_parts,
    "deep_message": _deep_message,
}


def _hostile_id(index: int) -> str:
    return f"tr_{index + 1:016x}"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A run directory: the worked example, one copy per hostile edit, and a 1 TiB frame."""
    root = tmp_path_factory.mktemp("hostile")
    run_dir = root / "run"
    run_dir.mkdir()
    write_record(worked_example(), run_dir)
    good = orjson.loads(zstandard.decompress((run_dir / f"{TR_ID}.json.zst").read_bytes()))
    ids = {}
    for index, (name, edit) in enumerate(HOSTILE.items()):
        trajectory_id = _hostile_id(index)
        document = orjson.loads(orjson.dumps(good))
        document["id"] = trajectory_id
        for kind in KINDS:
            file = f"{trajectory_id}.{kind}.zst"
            shutil.copy(run_dir / f"{TR_ID}.{kind}.zst", run_dir / file)
            document["sidecars"][kind]["file"] = file
        edit(document)
        data = zstandard.ZstdCompressor(write_checksum=True).compress(
            _dumps_deep(document) if name == "deep_message" else orjson.dumps(document)
        )
        (run_dir / f"{trajectory_id}.json.zst").write_bytes(data)
        ids[name] = trajectory_id
    ids["terabyte_frame"] = _hostile_id(len(HOSTILE))
    (run_dir / f"{ids['terabyte_frame']}.json.zst").write_bytes(_hostile_frame(2**40))
    return run_dir, ids


def _dumps_deep(document: dict) -> bytes:
    """orjson writes at most 254 levels; the stdlib writes a deeper (valid) document."""
    import json

    return json.dumps(document).encode()


def test_each_hostile_record_is_a_record_error_or_reads_safely(run) -> None:
    run_dir, ids = run
    assert load(run_dir, TR_ID).samples()  # the good record still reads
    for name, trajectory_id in ids.items():
        if name in ("text_parts", "deep_message", "no_text_array"):
            continue  # readable documents; the viewer must still serve them
        with pytest.raises(RecordError):
            load(run_dir, trajectory_id).samples()
    for name in ("message_null", "samples_list", "samples_rows", "huge_shape", "terabyte_frame"):
        problems, _ = check_document(run_dir, ids[name], sidecars=True)
        assert problems, name


def test_check_and_validate_name_each_file_and_read_the_rest(run) -> None:
    run_dir, ids = run
    for command in ("check", "validate"):
        result = subprocess.run(
            [sys.executable, "-m", "skycap.cli.main", command, str(run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        output = result.stdout + result.stderr
        assert "Traceback" not in output, output
        lines = output.splitlines()
        for name in ("message_null", "samples_list", "huge_shape", "terabyte_frame"):
            assert any(line.startswith(ids[name]) for line in lines), (command, name, output)
        if command == "check":
            assert any(line.startswith(TR_ID) and "linear" in line for line in lines), output


@pytest.fixture(scope="module")
def viewer(run) -> Iterator[str]:
    run_dir, _ = run
    server = make_server([run_dir.parent], port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.url.rstrip("/")
    server.shutdown()
    server.server_close()


def test_the_viewer_answers_every_route_of_every_record_without_a_500(run, viewer) -> None:
    _, ids = run
    with httpx.Client(base_url=viewer, timeout=30) as client:
        assert client.get("/api/v1/runs").status_code == 200
        for view in ("trajectories", "groups"):
            assert client.get(f"/api/v1/runs/run/{view}").status_code == 200
        for trajectory_id in [TR_ID, *ids.values()]:
            base = f"/api/v1/runs/run/trajectories/{trajectory_id}"
            for route in ("", "/paths/0", "/graph", "/calls"):
                response = client.get(base + route)
                assert response.status_code < 500, (trajectory_id, route, response.text)
        assert client.get(f"/api/v1/runs/run/trajectories/{TR_ID}").status_code == 200


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(
    kind=st.sampled_from([*KINDS, "document"]),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_the_reader_on_mutated_files_raises_only_record_errors(
    tmp_path_factory, kind, edits, cut
) -> None:
    """Random byte edits and truncations: a RecordError or a record that loads, nothing else."""
    record = tmp_path_factory.mktemp("fuzz")
    write_record(worked_example(), record)
    name = f"{TR_ID}.json.zst" if kind == "document" else f"{TR_ID}.{kind}.zst"
    data = bytearray((record / name).read_bytes())
    for position, value in edits:
        data[position % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    (record / name).write_bytes(bytes(data))
    try:
        load_trajectory(record, TR_ID)
    except RecordError:
        pass
    problems, _ = check_document(record, TR_ID, sidecars=True)
    assert isinstance(problems, list)

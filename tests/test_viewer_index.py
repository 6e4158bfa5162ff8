"""Runs found under folders and rescanned incrementally (docs/viewer.md "Running it")."""

from __future__ import annotations

from pathlib import Path

from test_viewer_fixtures import Build, tid

from skycap.viewer.index import Index


def write(record_dir: Path, n: int, *, reward: float = 1.0, mode: str = "text") -> str:
    build = Build(tid(n), mode=mode, annotations={"reward": reward})
    build.chat(1)
    return build.write(record_dir)


def test_runs_are_record_directories_up_to_two_levels_down(tmp_path: Path):
    root, other = tmp_path / "root", tmp_path / "other"
    write(root / "a", 1)
    write(root / "b" / "skycap", 2)
    write(root / "c" / "deep", 3)
    (root / "d").mkdir()
    write(other / "a", 4)
    index = Index([root, other], min_interval=0)
    index.refresh()
    paths = {name: run.path for name, run in index.runs.items()}
    assert paths == {
        "a": (root / "a").resolve(),
        "b": (root / "b" / "skycap").resolve(),
        "deep": (root / "c" / "deep").resolve(),
        "a~2": (other / "a").resolve(),
    }
    write(root / "e", 5)  # a run that appears while the viewer runs
    index.refresh()
    assert "e" in index.runs and index.runs["a"].path == (root / "a").resolve()


def test_a_root_holding_records_and_run_folders_lists_each(tmp_path: Path):
    """`serve` writes into ./records itself while the demo makes run folders inside it."""
    root = tmp_path / "records"
    write(root, 1)
    write(root / "demo-20261205-052612", 2)
    index = Index([root], min_interval=0)
    index.refresh()
    assert {name: len(run.snapshot()) for name, run in index.runs.items()} == {
        "records": 1,
        "demo-20261205-052612": 1,
    }


def test_a_record_directory_given_directly_is_one_run(tmp_path: Path):
    write(tmp_path / "skycap", 1)
    index = Index([tmp_path / "skycap"])
    index.refresh(force=True)
    assert list(index.runs) == [tmp_path.name]


def test_rescan_rereads_only_what_changed(tmp_path: Path):
    run_dir = tmp_path / "run"
    kept, changed, deleted = (write(run_dir, n) for n in (1, 2, 3))
    index = Index([run_dir], min_interval=0)
    index.refresh()
    run = index.runs["run"]
    before = dict(run.summaries)
    version = run.version

    index.refresh()
    assert run.version == version and run.summaries == before

    write(run_dir, 2, reward=0.75)
    (run_dir / f"{deleted}.json.zst").unlink()
    added = write(run_dir, 4)
    (run_dir / ".tr_0000000000000009.json.zst.tmp").write_bytes(b"partial")
    index.refresh()
    assert run.version == version + 1
    assert set(run.summaries) == {kept, changed, added}
    assert run.summaries[kept] is before[kept]  # not re-read
    assert run.summaries[changed].reward == 0.75


def test_a_sidecar_that_goes_missing_flags_its_record_without_a_document_change(tmp_path: Path):
    run_dir = tmp_path / "run"
    doc_id = write(run_dir, 1, mode="tokens")
    index = Index([run_dir], min_interval=0)
    index.refresh()
    run = index.runs["run"]
    assert "tokens-missing" not in run.summaries[doc_id].flags
    (run_dir / f"{doc_id}.tokens.zst").unlink()
    index.refresh()
    assert "tokens-missing" in run.summaries[doc_id].flags


def test_unreadable_documents_are_listed_with_their_problem(tmp_path: Path):
    run_dir = tmp_path / "run"
    write(run_dir, 1)
    (run_dir / "tr_00000000000000ff.json.zst").write_bytes(b"not zstd")
    index = Index([run_dir])
    index.refresh(force=True)
    summary = index.runs["run"].summaries["tr_00000000000000ff"]
    assert summary.status == "unreadable"
    assert summary.problems == ["not a zstd frame at byte 0"]
    assert index.listing()[0]["unreadable"] == 1

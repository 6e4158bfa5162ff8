"""Token-mode captures mirrored to S3 (moto), then read from the bucket by every reader.

`skycap check`, `validate` and `summary` on the `s3://` URL answer exactly as on the local
record directory; `skycap.load` rebuilds the same samples; the viewer's API over a mirror
that excluded the tokens sidecar flags `tokens-missing`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from mirror_fixtures import S3, s3_options
from server_fixtures import Control, ServerThread, wait_for

import skycap
from skycap.cli.main import main as skycap_main
from skycap.record.mirror import MirrorConfig, RecordMirror
from skycap.record.reader import RecordError
from skycap.record.remote import MirrorCache
from skycap.server.options import ServerOptions
from skycap.viewer.server import make_server

PREFIX = "run-7"


@pytest.fixture(scope="module")
def captured(
    s3: S3,
    token_server_options: Callable[..., ServerOptions],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Three finished token-mode trajectories (one forked), mirrored; their ids and places."""
    bucket = s3.bucket()
    records = tmp_path_factory.mktemp("records")
    url = f"s3://{bucket}/{PREFIX}"
    options = token_server_options(
        record_dir=records,
        record_mirror=url,
        record_mirror_config={"backoff": 0.01, "storage_options": s3_options(s3.endpoint)},
    )
    ids = []
    with ServerThread(options) as server, Control(server.url) as control:
        for n in range(3):
            trajectory = control.create({"step": 1, "instance_id": "a"})
            client = openai.OpenAI(
                base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
            )
            messages: list[Any] = [{"role": "user", "content": f"question {n}"}]
            first = client.chat.completions.create(model="p", messages=messages)
            messages.append({"role": "assistant", "content": first.choices[0].message.content})
            messages.append({"role": "user", "content": "more"})
            client.chat.completions.create(model="p", messages=messages)
            if n == 0:  # a retry from the first turn with other words: a fork
                client.chat.completions.create(
                    model="p", messages=[{"role": "user", "content": "question 0, again"}]
                )
            finished = control.finish(trajectory["id"], annotations={"reward": n / 2}).json()
            ids.append(finished["id"])
            assert finished["record"]["mirror"] == f"{url}/{finished['id']}.json.zst"
            assert finished["record"]["files"] == [
                f"{finished['id']}.tokens.zst",
                f"{finished['id']}.experts.zst",
                f"{finished['id']}.json.zst",
            ]
        mirror = server.store.records.mirror
        assert mirror.wait_idle(30)
        assert mirror.health()["mirrored"] == 3
    return {"bucket": bucket, "url": url, "records": records, "ids": ids}


@pytest.fixture
def cache_env(tmp_path: Path, s3: S3, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("SKYCAP_CACHE_DIR", str(tmp_path / "cache"))
    options = s3_options(s3.endpoint)
    monkeypatch.setenv("SKYCAP_STORAGE_OPTIONS", json.dumps(options))
    return options


def test_the_bucket_holds_byte_identical_copies(captured: dict[str, Any], s3: S3) -> None:
    local = {
        path.name: path.read_bytes()
        for path in captured["records"].iterdir()
        if path.is_file() and not path.name.startswith(".")
    }
    assert len(local) == 9
    assert s3.objects(captured["bucket"], f"{PREFIX}/") == local


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = skycap_main(list(argv))
    return code, capsys.readouterr().out


def test_check_validate_and_summary_answer_as_on_the_local_directory(
    captured: dict[str, Any], cache_env: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    local, url = str(captured["records"]), captured["url"]
    code, out = run_cli(capsys, "check", local)
    assert (code, out) == run_cli(capsys, "check", url)
    assert code == 1 and "of 3 trajectories linear" in out
    code, out = run_cli(capsys, "validate", local)
    mirrored = run_cli(capsys, "validate", url)
    assert code == 0 and mirrored == (0, out.replace(local, url))
    code, out = run_cli(capsys, "summary", "--json", local)
    mirrored_code, mirrored_out = run_cli(capsys, "summary", "--json", url)
    assert (json.loads(out)[0]["stats"], code) == (json.loads(mirrored_out)[0]["stats"], 0)
    # A flag instead of the environment, and a bad value, named.
    options = cache_env
    code, _ = run_cli(capsys, "check", "--storage-options", json.dumps(options), url)
    assert code == 1
    assert skycap_main(["check", "--storage-options", "[1]", url]) == 2
    assert "--storage-options must be a JSON object" in capsys.readouterr().err


def test_skycap_load_reads_a_record_from_the_mirror(
    captured: dict[str, Any], cache_env: dict[str, Any]
) -> None:
    for trajectory_id in captured["ids"]:
        local = skycap.load(captured["records"], trajectory_id).samples()
        remote = skycap.load(captured["url"], trajectory_id, storage_options=cache_env).samples()
        assert len(remote) == len(local) >= 1
        for a, b in zip(local, remote, strict=True):
            assert (a.input_ids, a.loss_mask, a.logprobs) == (b.input_ids, b.loss_mask, b.logprobs)
            assert a.input_ids and np.array_equal(a.routed_experts, b.routed_experts)
    with pytest.raises(RecordError, match="no record tr_0000000000000000"):
        skycap.load(captured["url"], "tr_0000000000000000")


def test_the_cache_fetches_only_what_changed(
    captured: dict[str, Any], s3: S3, tmp_path: Path
) -> None:
    cache = MirrorCache(captured["url"], s3_options(s3.endpoint), cache_dir=tmp_path / "c")
    path = cache.refresh(sidecars=False)
    assert sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) == sorted(
        f"{i}.json.zst" for i in captured["ids"]
    )
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir() if not p.name.startswith(".")}
    cache.refresh(sidecars=False)
    after = {p.name: p.stat().st_mtime_ns for p in path.iterdir() if not p.name.startswith(".")}
    assert before == after  # nothing re-fetched
    cache.refresh()
    assert len([p for p in path.iterdir() if not p.name.startswith(".")]) == 9


@pytest.fixture
def excluded(captured: dict[str, Any], s3: S3) -> Iterator[str]:
    """The same records mirrored to a second prefix without tokens and experts."""
    url = f"s3://{captured['bucket']}/no-tokens"
    mirror = RecordMirror(
        url,
        MirrorConfig(exclude=("tokens", "experts"), storage_options=s3_options(s3.endpoint)),
    )
    for trajectory_id in captured["ids"]:
        files = sorted(
            (p.name for p in captured["records"].glob(f"{trajectory_id}.*")),
            key=lambda name: name.endswith(".json.zst"),
        )
        mirror.submit(captured["records"], trajectory_id, files)
    assert mirror.wait_idle(30)
    assert all(mirror.location(i, [])["mirror_state"] == "excluded" for i in captured["ids"])
    yield url
    mirror.close()


def test_the_viewer_flags_excluded_tokens_as_missing_not_as_errors(
    excluded: str, s3: S3, tmp_path: Path
) -> None:
    cache = MirrorCache(excluded, s3_options(s3.endpoint), cache_dir=tmp_path / "view")
    server = make_server([], port=0, mirrors=[cache], mirror_interval=0.05)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with httpx.Client(base_url=server.url.rstrip("/"), timeout=10) as http:
            runs = http.get("/api/v1/runs").json()["runs"]
            assert [(r["name"], r["path"], r["trajectories"]) for r in runs] == [
                ("no-tokens", excluded, 3)
            ]
            rows = http.get("/api/v1/runs/no-tokens/trajectories").json()["rows"]
            assert all("tokens-missing" in row["flags"] for row in rows)
            assert all(row["status"] == "finished" for row in rows)
            detail = http.get(f"/api/v1/runs/no-tokens/trajectories/{rows[0]['id']}").json()
            assert detail["problems"] == []
    finally:
        server.shutdown()
        server.server_close()


def test_the_viewer_sees_new_records_at_its_refresh_interval(
    captured: dict[str, Any], s3: S3, tmp_path: Path
) -> None:
    url = f"s3://{captured['bucket']}/growing"
    options = s3_options(s3.endpoint)
    mirror = RecordMirror(url, MirrorConfig(storage_options=options))
    first, second = captured["ids"][:2]
    mirror.submit(captured["records"], first, [f"{first}.json.zst"])
    assert mirror.wait_idle(30)
    cache = MirrorCache(url, options, cache_dir=tmp_path / "grow")
    server = make_server([], port=0, mirrors=[cache], mirror_interval=0.05)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with httpx.Client(base_url=server.url.rstrip("/"), timeout=10) as http:

            def count() -> int:
                return http.get("/api/v1/runs").json()["runs"][0]["trajectories"]

            assert count() == 1
            mirror.submit(captured["records"], second, [f"{second}.json.zst"])
            assert mirror.wait_idle(30)
            wait_for(lambda: count() == 2, 20, "the viewer to list the new record")
    finally:
        server.shutdown()
        server.server_close()
        mirror.close()

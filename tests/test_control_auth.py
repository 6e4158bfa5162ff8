"""The control token over real sockets: who may use control routes, how clients find it."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import Control, ServerThread, make_server, stderr_to_exit, upstream

from skycap import CaptureError, CapturePool, CaptureService
from skycap.control_token import (
    ENV,
    default_token_file,
    find_control_token,
    is_this_machine,
    write_token_file,
)
from skycap.mock.upstream import ScriptedUpstream
from skycap.record.reader import read_document
from skycap.server.options import ServerOptions, from_values

MESSAGES = [{"role": "user", "content": "solve it"}]
SKYCAP = [sys.executable, "-m", "skycap.cli.main"]
URL_LINE = re.compile(r"listening on (http://\S+)")
TOKEN_LINE = re.compile(r"control token in (\S+) \(mode 0600\)")


def routes(trajectory_id: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every control route, with a body that would succeed if the credential were right."""
    return [
        ("GET", "/trajectories", None),
        ("POST", "/trajectories", {"meta": {"task": "x"}}),
        ("GET", f"/trajectories/{trajectory_id}", None),
        ("POST", f"/trajectories/{trajectory_id}/finish", {"annotations": {"reward": 1.0}}),
    ]


def call(url: str, method: str, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=10)


def chat(created: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{created['base_url']}/chat/completions",
        json={"model": "m", "messages": MESSAGES},
        headers={"Authorization": f"Bearer {created['api_key']}"},
        timeout=10,
    )


def test_every_control_route_refuses_a_missing_or_wrong_token(make_server) -> None:
    server = make_server()
    with Control(server.url) as control:
        trajectory_id = control.create()["id"]
    for headers in ({}, {"Authorization": "Bearer skycap-control-not-the-token-at-all"}):
        for method, path, body in routes(trajectory_id):
            response = call(server.url, method, path, body, headers)
            assert response.status_code == 401, (method, path, response.text)
            assert response.headers["www-authenticate"].startswith("Bearer")
            error = response.json()
            assert error["code"] == "control_token_required"
            assert "Authorization: Bearer <control token>" in error["error"] or (
                "not this server's" in error["error"]
            )
    # Nothing was created or finished by the refused calls.
    with Control(server.url) as control:
        listing = control.http.get("/trajectories").json()
    assert [row["id"] for row in listing] == [trajectory_id]
    assert listing[0]["status"] == "open"


def test_a_harness_key_on_a_control_route_is_forbidden(make_server) -> None:
    server = make_server(require_api_key=True)
    with Control(server.url) as control:
        created = control.create()
    assert chat(created).status_code == 200
    key = created["api_key"]
    for headers in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}):
        for method, path, body in [*routes(created["id"]), ("GET", "/healthz", None)]:
            response = call(server.url, method, path, body, headers)
            assert response.status_code == 403, (method, path, headers, response.text)
            assert response.json()["code"] == "forbidden"
            assert "control token" in response.json()["error"]


def test_the_reward_first_attack_fails_and_the_trainers_reward_is_recorded(
    make_server, tmp_path: Path
) -> None:
    """The policy, holding only its trajectory key, tries to finish itself with reward 1.0."""
    server = make_server(require_api_key=True, record_dir=tmp_path)
    with Control(server.url) as control:
        created = control.create({"task": "hard"})
        assert chat(created).status_code == 200
        attack = httpx.post(
            f"{server.url}/trajectories/{created['id']}/finish",
            json={"annotations": {"reward": 1.0}},
            headers={"Authorization": f"Bearer {created['api_key']}"},
        )
        assert attack.status_code == 403
        finished = control.finish(created["id"], annotations={"reward": 0.0})
    assert finished.status_code == 200, finished.text
    document = read_document(tmp_path / f"{created['id']}.json.zst")
    assert document["annotations"] == {"reward": 0.0}
    assert document["status"] == "finished"


def test_healthz_without_a_token_is_liveness_only(make_server) -> None:
    server = make_server()
    anonymous = httpx.get(f"{server.url}/healthz")
    assert anonymous.status_code == 200 and anonymous.json() == {"ok": True}
    wrong = httpx.get(f"{server.url}/healthz", headers={"Authorization": "Bearer nope-nope-nope"})
    assert wrong.status_code == 401
    with Control(server.url) as control:
        detailed = control.http.get("/healthz").json()
    assert detailed["ok"] is True and detailed["capture"] == {"mode": "text"}
    assert "calls_total" in detailed


def test_unknown_paths_stay_404_without_a_token(make_server) -> None:
    server = make_server()
    response = httpx.get(f"{server.url}/nothing/here")
    assert response.status_code == 404 and "no route" in response.json()["error"]


def test_the_service_holds_its_token_and_pools_find_it(make_server) -> None:
    server = make_server(control_token="skycap-control-chosen-by-the-trainer")
    assert server.control_token == "skycap-control-chosen-by-the-trainer"
    assert "chosen-by" not in repr(server.options)

    async def run() -> tuple[str, str]:
        async with server.pool() as pool:
            held = await pool.create({"via": "service.pool"})
            held_result = await held.finish({"reward": 1})
        # The documented two lines: a pool given only the URL finds the in-process token.
        async with CapturePool([server.url]) as pool:
            found = await pool.create({"via": "url"})
            found_result = await found.finish({"reward": 2})
        return held_result.status, found_result.status

    assert asyncio.run(run()) == ("finished", "finished")

    async def wrong() -> None:
        async with CapturePool([server.url], control_token="skycap-control-wrong-token") as pool:
            await pool.create()

    with pytest.raises(CaptureError) as refused:
        asyncio.run(wrong())
    assert refused.value.status == 401


def test_serve_stops_when_the_token_file_cannot_be_written(upstream: ScriptedUpstream) -> None:
    done = subprocess.run(
        [
            *SKYCAP,
            "serve",
            "--port",
            "0",
            "--upstream-url",
            upstream.base_url,
            "--control-token-file",
            "/proc/skycap-cannot-write-here",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert "cannot write the control token to /proc/skycap-cannot-write-here" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_pool_that_finds_no_token_says_how_to_pass_one(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    process, url, _ = serve(
        "--upstream-url", upstream.base_url, "--control-token-file", str(tmp_path / "token")
    )
    try:

        async def run() -> None:
            async with CapturePool([url]) as pool:
                await pool.create()

        with pytest.raises(CaptureError) as refused:
            asyncio.run(run())
        assert refused.value.status == 401
        assert "control_token=" in refused.value.message and ENV in refused.value.message
    finally:
        stop(process)


def serve(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, str]:
    """`skycap serve` in a subprocess: (process, URL, its start lines); records in memory."""
    process = subprocess.Popen(
        [*SKYCAP, "serve", "--port", "0", "--no-record-dir", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env or dict(os.environ),
        text=True,
    )
    assert process.stderr is not None
    lines = process.stderr.readline() + process.stderr.readline()
    match = URL_LINE.search(lines)
    assert match, f"no start line from skycap serve: {lines!r}"
    return process, match.group(1), lines


def stop(process: subprocess.Popen) -> str:
    process.terminate()
    return stderr_to_exit(process, timeout=30)


def test_serve_writes_a_0600_token_file_that_clients_find(upstream: ScriptedUpstream) -> None:
    process, url, lines = serve("--upstream-url", upstream.base_url)
    try:
        port = int(url.rsplit(":", 1)[1])
        match = TOKEN_LINE.search(lines)
        assert match, lines
        path = Path(match.group(1))
        assert path == default_token_file(port)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        assert token.startswith("skycap-control-") and len(token) > 40
        assert find_control_token(url) == token
        assert httpx.get(f"{url}/trajectories").status_code == 401

        async def run() -> str:
            async with CapturePool([url]) as pool:  # no token given: read from the file
                trajectory = await pool.create({"from": "file"})
                return (await trajectory.finish({"reward": 1})).status

        assert asyncio.run(run()) == "finished"
        top = subprocess.run(
            [*SKYCAP, "top", "--once", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert top.returncode == 0, top.stdout + top.stderr
        assert "HTTP 401" not in top.stdout
    finally:
        rest = stop(process)
    assert "Traceback" not in rest
    assert not path.exists(), "a clean stop removes the token file it wrote"


def test_control_token_env_gives_the_token_and_top_takes_it(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    token = "skycap-control-given-in-a-variable"
    env = {**os.environ, "MY_CONTROL": token}
    token_file = tmp_path / "conf" / "token"
    process, url, lines = serve(
        "--upstream-url",
        upstream.base_url,
        "--control-token-env",
        "MY_CONTROL",
        "--control-token-file",
        str(token_file),
        env=env,
    )
    try:
        assert f"control token in {token_file}" in lines
        assert token_file.read_text().strip() == token
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        headers = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"{url}/trajectories", headers=headers).status_code == 200
        # No default file for this port: top needs the variable.
        top_args = [*SKYCAP, "top", "--once", url]
        without = subprocess.run(top_args, capture_output=True, text=True, timeout=60)
        assert without.returncode == 1 and "HTTP 401" in without.stdout
        given = subprocess.run(
            [*top_args, "--control-token-env", "MY_CONTROL"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert given.returncode == 0, given.stdout + given.stderr
    finally:
        stop(process)


def test_no_control_token_opens_the_routes_with_a_warning(upstream: ScriptedUpstream) -> None:
    process, url, lines = serve("--upstream-url", upstream.base_url, "--no-control-token")
    try:
        assert "control token in" not in lines
        assert httpx.post(f"{url}/trajectories", json={}).status_code == 200
        assert "calls_total" in httpx.get(f"{url}/healthz").json()
    finally:
        rest = stop(process)
    assert "the control token is off (--no-control-token)" in lines + rest


def test_find_control_token_order(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "http://127.0.0.1:1"  # no server: only the variable and the file can answer
    monkeypatch.delenv(ENV, raising=False)
    assert find_control_token(url) is None
    write_token_file(default_token_file(1), "skycap-control-in-the-default-file")
    try:
        assert find_control_token(url) == "skycap-control-in-the-default-file"
        assert find_control_token("http://localhost:1") == "skycap-control-in-the-default-file"
        # A host that is not this machine never gets a local file's token.
        assert find_control_token("http://192.0.2.1:1") is None
        monkeypatch.setenv(ENV, "skycap-control-from-the-environment")
        assert find_control_token(url) == "skycap-control-from-the-environment"
        assert find_control_token("http://192.0.2.1:1") == "skycap-control-from-the-environment"
    finally:
        default_token_file(1).unlink()
    assert is_this_machine("127.0.0.1") and not is_this_machine("192.0.2.1")


def test_token_options_are_checked_before_start(monkeypatch: pytest.MonkeyPatch) -> None:
    generated = ServerOptions("http://127.0.0.1:9/v1")
    assert generated.control_token and generated.control_token.startswith("skycap-control-")
    assert ServerOptions("http://127.0.0.1:9/v1").control_token != generated.control_token
    assert ServerOptions("http://127.0.0.1:9/v1", no_control_token=True).control_token is None
    with pytest.raises(ValueError, match="at least 16"):
        ServerOptions("http://127.0.0.1:9/v1", control_token="short")
    with pytest.raises(ValueError, match="turns the control token off"):
        ServerOptions("http://127.0.0.1:9/v1", no_control_token=True, control_token="x" * 20)
    monkeypatch.delenv("UNSET_TOKEN_VARIABLE", raising=False)
    with pytest.raises(ValueError, match="UNSET_TOKEN_VARIABLE is not set"):
        from_values({"upstream_url": "http://h/v1", "control_token_env": "UNSET_TOKEN_VARIABLE"})


def test_an_embedded_service_without_a_token_warns(
    upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="skycap.server"):
        service = CaptureService(upstream.base_url, no_control_token=True)
        url = service.start()
        try:
            assert service.control_token is None
            assert httpx.post(f"{url}/trajectories", json={}).status_code == 200
        finally:
            service.stop()
    assert any("--no-control-token" in r.getMessage() for r in caplog.records)

"""`skycap serve` as a process: 64 concurrent trajectories x 10 turns, SIGTERM, the CLI surface."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from server_fixtures import stderr_to_exit, upstream, wait_for

from skycap.control_token import default_token_file
from skycap.mock.upstream import ScriptedUpstream
from skycap.record.reader import read_document

ROOT = Path(__file__).resolve().parent.parent
TRAJECTORIES = 64
TURNS = 10
URL_LINE = re.compile(r"listening on (http://\S+)")


def skycap(*args: str) -> list[str]:
    return [sys.executable, "-m", "skycap.cli.main", *args]


class ServeProcess:
    """`skycap serve` in a subprocess; the URL comes from its one start line on stderr."""

    def __init__(self, *args: str, cwd: Path | None = None) -> None:
        env = {**os.environ, "SKYCAP_UPSTREAM_API_KEY": "sk-upstream-test"}
        self.process = subprocess.Popen(
            skycap("serve", "--port", "0", *args),
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            text=True,
            cwd=cwd,
        )
        assert self.process.stderr is not None
        self.first_line = self.process.stderr.readline()
        match = URL_LINE.search(self.first_line)
        assert match, f"no start line from skycap serve: {self.first_line!r}"
        self.url = match.group(1)
        token_line = self.process.stderr.readline()
        path = re.search(r"control token in (\S+) ", token_line)
        assert path, f"no control token line from skycap serve: {token_line!r}"
        self.token = Path(path.group(1)).read_text().strip()

    def terminate(self, timeout: float = 30) -> tuple[int, str]:
        self.process.send_signal(signal.SIGTERM)
        rest = stderr_to_exit(self.process, timeout)
        return self.process.returncode, rest


@pytest.fixture
def serve(upstream: ScriptedUpstream, tmp_path: Path) -> Iterator[ServeProcess]:
    process = ServeProcess("--upstream-url", upstream.base_url, "--record-dir", str(tmp_path))
    yield process
    if process.process.poll() is None:
        process.process.kill()
        process.process.wait()


async def run_trajectory(client: httpx.AsyncClient, url: str, index: int) -> str:
    created = (await client.post(f"{url}/trajectories", json={"meta": {"index": index}})).json()
    base, key = created["base_url"], created["api_key"]
    messages: list[dict] = [{"role": "system", "content": f"agent {index}"}]
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"trajectory {index} turn {turn}"})
        body = {"model": "policy", "messages": messages, "stream": turn % 2 == 1}
        response = await client.post(
            f"{base}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200, response.text
        if body["stream"]:
            text = "".join(
                (event["choices"][0]["delta"].get("content") or "")
                for line in response.text.split("\n\n")
                if line.startswith("data: {")
                for event in [orjson.loads(line[6:])]
                if event["choices"]
            )
        else:
            text = response.json()["choices"][0]["message"]["content"]
        assert text == f"echo: trajectory {index} turn {turn}"
        messages.append({"role": "assistant", "content": text})
    if index % 2 == 0:
        finished = await client.post(f"{url}/trajectories/{created['id']}/finish", json={})
        assert finished.json()["status"] == "finished"
    return created["id"]


async def load(url: str, token: str) -> list[str]:
    limits = httpx.Limits(max_connections=TRAJECTORIES + 8, max_keepalive_connections=TRAJECTORIES)
    headers = {"Authorization": f"Bearer {token}"}  # harness calls send their own key
    async with httpx.AsyncClient(timeout=60, limits=limits, headers=headers) as client:
        return await asyncio.gather(*(run_trajectory(client, url, i) for i in range(TRAJECTORIES)))


def test_64_concurrent_trajectories_then_sigterm(
    serve: ServeProcess, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    # The start line shows at the default log level, as news rather than a warning.
    assert serve.first_line.startswith("skycap text mode listening on http://127.0.0.1:")
    ids = asyncio.run(load(serve.url, serve.token))
    assert len(set(ids)) == TRAJECTORIES
    code, stderr = serve.terminate()
    assert code == 0 and "Traceback" not in stderr
    # Ctrl-C or SIGTERM says what it did with the trajectories no finish had ended.
    half = TRAJECTORIES // 2
    assert f"skycap serve: stopped; wrote {half} open trajectories (status open) to " in stderr
    assert all(r.header("authorization") == "Bearer sk-upstream-test" for r in upstream.requests)
    for index, trajectory_id in enumerate(ids):
        document = read_document(tmp_path / f"{trajectory_id}.json.zst")
        assert document["meta"] == {"index": index}
        assert document["status"] == ("finished" if index % 2 == 0 else "open")
        assert document["ended"] is (index % 2 == 0)
        model_nodes = [n for n in document["nodes"] if n["author"] == "model"]
        assert len(model_nodes) == TURNS and all(len(n["calls"]) == 1 for n in model_nodes)
        texts = [n["message"]["content"] for n in document["nodes"]]
        assert all(f"trajectory {index} turn" in t for t in texts[1:])
    check = subprocess.run(skycap("check", str(tmp_path)), capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.splitlines()[-1] == f"{TRAJECTORIES} of {TRAJECTORIES} trajectories linear"


def test_records_go_to_dot_records_unless_memory_only_is_asked_for(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    serve = ServeProcess("--upstream-url", upstream.base_url, "--ttl", "90", cwd=tmp_path)
    records = tmp_path / "records"
    try:
        where = serve.process.stderr.readline()  # after the listening and token lines
        assert where.strip() == (
            f"records: {records}; a trajectory idle for 90 s is ended as abandoned and "
            "written (--ttl)"
        )
        # docs/serving.md "The control token" shows the start lines in the order printed.
        started = [serve.first_line, "control token", where]
        documented = (ROOT / "docs" / "serving.md").read_text().split("```text\n")[1]
        firsts = [line.split(" ")[:1] for line in documented.splitlines()[:3]]
        assert firsts == [line.split(" ")[:1] for line in started]
        headers = {"Authorization": f"Bearer {serve.token}"}
        created = httpx.post(f"{serve.url}/trajectories", json={}, headers=headers).json()
    finally:
        code, rest = serve.terminate()
    assert code == 0 and "WARNING" not in rest
    assert rest.splitlines()[-1] == (
        f"skycap serve: stopped; wrote 1 open trajectory (status open) to {records}: "
        f"{created['id']}"
    )
    assert read_document(records / f"{created['id']}.json.zst")["status"] == "open"

    memory = ServeProcess("--upstream-url", upstream.base_url, "--no-record-dir", cwd=tmp_path)
    try:
        assert "records: memory only (--no-record-dir)" in memory.process.stderr.readline()
        warning = memory.process.stderr.readline()
        assert "WARNING" in warning and "lost when the server stops" in warning
    finally:
        code, rest = memory.terminate()
    assert rest.splitlines()[-1] == "skycap serve: stopped; no trajectory was open"
    assert code == 0 and len(list(records.glob("*.json.zst"))) == 1  # none from memory

    both = subprocess.run(
        skycap(
            "serve", "--upstream-url", upstream.base_url, "--no-record-dir", "--record-dir", "x"
        ),
        capture_output=True,
        text=True,
    )
    assert both.returncode == 2 and "exclude each other" in both.stderr


def test_serve_usage_errors_and_version() -> None:
    version = subprocess.run(skycap("--version"), capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("skycap ")
    missing = subprocess.run(skycap("serve"), capture_output=True, text=True)
    assert missing.returncode == 2 and "upstream_url (--upstream-url) is required" in missing.stderr
    tokens = subprocess.run(
        skycap("serve", "--upstream-url", "http://127.0.0.1:9", "--mode", "tokens"),
        capture_output=True,
        text=True,
    )
    assert tokens.returncode == 2 and "--mode tokens needs --tokenizer" in tokens.stderr
    assert "Traceback" not in missing.stderr + tokens.stderr


def test_serve_reports_a_port_in_use(upstream: ScriptedUpstream) -> None:
    port = upstream.base_url.rsplit(":", 1)[1].split("/")[0]
    taken = subprocess.run(
        skycap("serve", "--upstream-url", upstream.base_url, "--port", port),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert taken.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    assert "Traceback" not in taken.stderr
    proxy = subprocess.run(
        skycap("serve", "--upstream-url", upstream.base_url, "--port", "0", "--proxy-port", port),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proxy.returncode == 1 and f"listener cannot listen on 127.0.0.1:{port}" in proxy.stderr
    assert "pass another --proxy-port" in proxy.stderr and "Traceback" not in proxy.stderr


def test_the_mitmdump_script(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    mitmdump = Path(sys.executable).parent / "mitmdump"
    script = Path(__file__).parents[1] / "addons" / "skycap.py"
    process = subprocess.Popen(
        [
            str(mitmdump),
            "-s",
            str(script),
            "--mode",
            "reverse:http://127.0.0.1:9",
            "--listen-host",
            "127.0.0.1",
            "--listen-port",
            "0",
            "--set",
            "connection_strategy=lazy",
            "--set",
            "keep_host_header=true",
            "--set",
            f"skycap_upstream_url={upstream.base_url}",
            "--set",
            f"skycap_record_dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        # mitmproxy says it listens before the addon's `running` hook writes the token:
        # read on until the addon names its token file too.
        address = token_path = None
        for line in process.stdout:
            if match := re.search(r"listening at (127\.0\.0\.1:\d+)", line):
                address = match.group(1)
            if match := re.search(r"control token is in (\S+)", line):
                token_path = match.group(1)
            if address and token_path:
                break
        else:
            pytest.fail("mitmdump did not start")
        url = f"http://{address}"
        token_file = default_token_file(int(address.rsplit(":", 1)[1]))
        assert str(token_file) == token_path
        token = token_file.read_text().strip()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        headers = {"Authorization": f"Bearer {token}"}
        assert httpx.post(f"{url}/trajectories", json={}).status_code == 401
        created = httpx.post(f"{url}/trajectories", json={}, headers=headers).json()
        assert created["base_url"] == f"{url}/t/{created['id']}/v1"
        reply = httpx.post(
            f"{created['base_url']}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "via mitmdump"}]},
        )
        assert reply.json()["choices"][0]["message"]["content"] == "echo: via mitmdump"
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stored = read_document(tmp_path / f"{created['id']}.json.zst")
    assert stored["status"] == "open" and len(stored["nodes"]) == 2

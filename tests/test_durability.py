"""Nothing answered is lost: SIGTERM and kill -9 while 50 trajectories call, then the records."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import orjson
import pytest
from server_fixtures import make_server, stderr_to_exit, upstream
from test_server_load import URL_LINE, skycap
from test_server_load import ServeProcess as _ServeProcess

from skycap.mock.upstream import ScriptedUpstream
from skycap.record.reader import read_document

TRAJECTORIES = 50


class ServeProcess(_ServeProcess):
    """`skycap serve` whose start line may follow a warning (journals replayed at start)."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "SKYCAP_UPSTREAM_API_KEY": "sk-upstream-test"}
        self.process = subprocess.Popen(
            skycap("serve", "--port", "0", *args),
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert self.process.stderr is not None
        self.before: list[str] = []
        while (line := self.process.stderr.readline()) and not URL_LINE.search(line):
            self.before.append(line)
        match = URL_LINE.search(line)
        assert match, f"no start line from skycap serve: {self.before!r}"
        self.first_line, self.url = line, match.group(1)
        token_line = self.process.stderr.readline()
        path = re.search(r"control token in (\S+) ", token_line)
        assert path, f"no control token line from skycap serve: {token_line!r}"
        self.token = Path(path.group(1)).read_text().strip()


class Traffic:
    """50 trajectories calling turn after turn until the server goes away.

    `answered[i]` holds every reply text trajectory i received whole: exactly the calls
    its record must hold.
    """

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.token = token
        self.ids: list[str] = []
        self.answered: list[list[str]] = [[] for _ in range(TRAJECTORIES)]
        self.refusals: list[int] = []

    @property
    def total(self) -> int:
        return sum(len(a) for a in self.answered)

    async def run(self, stop: asyncio.Event) -> None:
        limits = httpx.Limits(max_connections=TRAJECTORIES + 8)
        headers = {"Authorization": f"Bearer {self.token}"}  # harness calls send their key
        async with httpx.AsyncClient(timeout=30, limits=limits, headers=headers) as client:
            created = [
                (await client.post(f"{self.url}/trajectories", json={"meta": {"i": i}})).json()
                for i in range(TRAJECTORIES)
            ]
            self.ids = [c["id"] for c in created]
            await asyncio.gather(*(self._calls(client, i, c, stop) for i, c in enumerate(created)))

    async def _calls(self, client: httpx.AsyncClient, index: int, created: dict, stop) -> None:
        messages: list[dict] = []
        turn = 0
        while not stop.is_set():
            messages.append({"role": "user", "content": f"t{index} turn {turn}"})
            body = {"model": "policy", "messages": messages, "stream": turn % 2 == 1}
            try:
                response = await client.post(
                    f"{created['base_url']}/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {created['api_key']}"},
                )
            except httpx.HTTPError:
                return
            if response.status_code != 200:
                self.refusals.append(response.status_code)
                return
            text = _reply_text(response, body["stream"])
            if text is None:  # cut off mid-answer: not answered
                return
            self.answered[index].append(text)
            messages.append({"role": "assistant", "content": text})
            turn += 1


def _reply_text(response: httpx.Response, stream: bool) -> str | None:
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    if "data: [DONE]" not in response.text:
        return None
    return "".join(
        (event["choices"][0]["delta"].get("content") or "")
        for line in response.text.split("\n\n")
        if line.startswith("data: {")
        for event in [orjson.loads(line[6:])]
        if event["choices"]
    )


async def _traffic_until(serve: ServeProcess, calls: int, then) -> Traffic:
    """Run the traffic; once `calls` are answered, call `then()` and let the traffic end."""
    traffic = Traffic(serve.url, serve.token)
    stop = asyncio.Event()
    task = asyncio.create_task(traffic.run(stop))
    deadline = time.monotonic() + 60
    while traffic.total < calls:
        assert time.monotonic() < deadline, f"only {traffic.total} calls answered"
        assert not task.done(), task.exception()
        await asyncio.sleep(0.01)
    then()
    await asyncio.wait_for(task, 60)
    stop.set()
    return traffic


def _recorded_replies(record_dir: Path, trajectory_id: str) -> tuple[dict, list[str]]:
    document = read_document(record_dir / f"{trajectory_id}.json.zst")
    replies = [
        node["message"]["content"]
        for node in document["nodes"]
        for _ in node["calls"]
        if node["author"] == "model"
    ]
    return document, replies


def _assert_every_answer_recorded(record_dir: Path, traffic: Traffic) -> None:
    for index, trajectory_id in enumerate(traffic.ids):
        _, replies = _recorded_replies(record_dir, trajectory_id)
        missing = [text for text in traffic.answered[index] if text not in replies]
        assert not missing, f"{trajectory_id}: answered but not recorded: {missing}"


@pytest.fixture
def slow_upstream(upstream: ScriptedUpstream) -> ScriptedUpstream:
    upstream.chunk_delay = 0.003  # calls overlap the shutdown or the kill
    return upstream


def test_sigterm_while_50_trajectories_call(slow_upstream: ScriptedUpstream, tmp_path: Path):
    serve = ServeProcess("--upstream-url", slow_upstream.base_url, "--record-dir", str(tmp_path))
    try:
        sigterm = lambda: serve.process.send_signal(signal.SIGTERM)  # noqa: E731
        traffic = asyncio.run(_traffic_until(serve, 150, sigterm))
        stderr = stderr_to_exit(serve.process, timeout=60)
    finally:
        if serve.process.poll() is None:
            serve.process.kill()
    assert serve.process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert traffic.total >= 150
    _assert_every_answer_recorded(tmp_path, traffic)
    # Each trajectory was written as it stood, status unchanged, and no journal is left.
    for trajectory_id in traffic.ids:
        document, _ = _recorded_replies(tmp_path, trajectory_id)
        assert document["status"] == "open" and document["ended"] is False
    assert not list((tmp_path / ".journal").glob("*.jsonl"))
    assert all(status == 503 for status in traffic.refusals), traffic.refusals


def test_kill_9_mid_traffic_then_restart(slow_upstream: ScriptedUpstream, tmp_path: Path):
    args = ("--upstream-url", slow_upstream.base_url, "--record-dir", str(tmp_path))
    serve = ServeProcess(*args)
    try:
        kill = lambda: os.kill(serve.process.pid, signal.SIGKILL)  # noqa: E731
        traffic = asyncio.run(_traffic_until(serve, 150, kill))
        serve.process.wait(30)
    finally:
        if serve.process.poll() is None:
            serve.process.kill()
    assert not list(tmp_path.glob("*.json.zst")), "a killed server wrote no record"
    journals = sorted(p.name for p in (tmp_path / ".journal").glob("*.jsonl"))
    assert journals == sorted(f"{i}.jsonl" for i in traffic.ids)

    again = ServeProcess(*args)
    try:
        # The restart replayed every journal into a record before it served.
        assert any(f"rebuilt {TRAJECTORIES} trajectories" in line for line in again.before)
        _assert_every_answer_recorded(tmp_path, traffic)
        assert not list((tmp_path / ".journal").glob("*.jsonl"))
        headers = {"Authorization": f"Bearer {again.token}"}
        with httpx.Client(base_url=again.url, timeout=30, headers=headers) as client:
            first = traffic.ids[0]
            document = client.get(f"/trajectories/{first}").json()
            assert document["status"] == "open" and document["ended"] is False
            assert "crash journal" in document["failures"][-1]["error"]
            call = client.post(
                f"/t/{first}/v1/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": "more"}]},
                headers={"Authorization": "Bearer sk-any"},
            )
            assert call.status_code == 410, call.text
            assert "finish it" in call.json()["error"]["message"]
            for index, trajectory_id in enumerate(traffic.ids):
                finished = client.post(
                    f"/trajectories/{trajectory_id}/finish", json={"annotations": {"r": index}}
                )
                assert finished.status_code == 200, finished.text
                assert finished.json()["status"] == "finished"
        code, stderr = again.terminate()
    finally:
        if again.process.poll() is None:
            again.process.kill()
    assert code == 0 and "Traceback" not in stderr
    check = subprocess.run(skycap("check", str(tmp_path)), capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_call_after_shutdown_began_is_503_and_the_status_unchanged(
    make_server, tmp_path: Path
) -> None:
    import openai
    from server_fixtures import Control

    server = make_server(record_dir=tmp_path)
    with Control(server.url) as control:
        created = control.create()
        client = openai.OpenAI(
            base_url=created["base_url"], api_key=created["api_key"], max_retries=0
        )
        messages = [{"role": "user", "content": "before"}]
        client.chat.completions.create(model="policy", messages=messages)
        server.run_in_loop(server.store.close_to_calls)
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model="policy", messages=messages)
        assert refused.value.status_code == 503
        assert refused.value.code == "server_shutting_down"
        assert control.document(created["id"]).json()["status"] == "open"
    server.stop()
    document, replies = _recorded_replies(tmp_path, created["id"])
    assert document["status"] == "open" and replies == ["echo: before"]


def test_a_keep_alive_call_while_records_are_written_is_not_lost(
    make_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shutdown's writes are held open; a call on a connection opened before then is
    either refused or in the record, never answered and lost."""
    import threading

    from skycap.server import records as records_module

    entered, release = threading.Event(), threading.Event()
    real = records_module.write_record

    def held_write(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    server = make_server(record_dir=tmp_path)
    with httpx.Client(timeout=10) as client:
        auth = {"Authorization": f"Bearer {server.control_token}"}
        created = client.post(f"{server.url}/trajectories", json={}, headers=auth).json()
        url = f"{created['base_url']}/chat/completions"

        def call(content: str) -> httpx.Response:
            body = {"model": "policy", "messages": [{"role": "user", "content": content}]}
            return client.post(url, json=body)

        assert call("before").status_code == 200
        monkeypatch.setattr(records_module, "write_record", held_write)
        stopping = threading.Thread(target=server.stop)
        stopping.start()
        assert entered.wait(30), "the shutdown write never started"
        try:
            late = call("during")
        except httpx.HTTPError:
            late = None
        release.set()
        stopping.join(30)
    _, replies = _recorded_replies(tmp_path, created["id"])
    assert "echo: before" in replies
    if late is not None and late.status_code == 200:
        assert "echo: during" in replies, "answered during the shutdown write, then lost"
    else:
        assert late is None or late.status_code == 503


def test_a_messages_call_after_shutdown_began_is_503_in_the_anthropic_shape(
    make_server, tmp_path: Path
) -> None:
    """The shutdown refusal is in the caller's own error shape, like every other refusal."""
    import anthropic
    from server_fixtures import Control

    server = make_server(record_dir=tmp_path)
    with Control(server.url) as control:
        created = control.create()
        server.run_in_loop(server.store.close_to_calls)
        client = anthropic.Anthropic(
            base_url=created["anthropic_base_url"], api_key=created["api_key"], max_retries=0
        )
        with pytest.raises(anthropic.InternalServerError) as refused:
            client.messages.create(
                model="policy", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
            )
        assert refused.value.status_code == 503
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["message"].startswith("the capture server is shutting")
    server.stop()

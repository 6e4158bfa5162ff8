"""Token mode through the server: the addon answers from the token backend, dedups, records."""
# ruff: noqa: F401, F811 - pytest fixtures are imported from server_fixtures by name

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_fixtures import Control, ServerThread, control

from skycap.mock.engine import ScriptedEngine
from skycap.record.reader import read_document
from skycap.server.options import ServerOptions

START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "find x"}]


@pytest.fixture(scope="module")
def server(
    token_server_options: Callable[..., ServerOptions], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    options = token_server_options(record_dir=tmp_path_factory.mktemp("records"))
    with ServerThread(options) as server:
        yield server


def test_an_episode_is_captured_with_tokens(server: ServerThread, control: Control) -> None:
    trajectory = control.create()
    client = openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )
    messages: list[Any] = [dict(m) for m in START]
    for turn in range(3):
        if turn == 1:
            chunks = list(client.chat.completions.create(model="p", messages=messages, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            if calls:
                message["tool_calls"] = [
                    {"id": t.id, "type": "function", "function": t.function.model_dump()}
                    for t in calls
                ]
        else:
            reply = client.chat.completions.create(model="p", messages=messages)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        for call in message.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": "and again?"})
    health = control.http.get("/healthz").json()
    assert health["capture"]["mode"] == "tokens" and health["tokens_total"] > 0
    listing = control.http.get("/trajectories").json()
    assert listing[0]["calls"] == 3 and listing[0]["last_call"]["finish_reason"]
    result = control.finish(trajectory["id"], annotations={"reward": 1}).json()
    sample = result["samples"][0]
    assert len(sample["input_ids"]) == len(sample["loss_mask"]) == len(sample["logprobs"])
    assert sum(sample["loss_mask"]) > 0
    files = result["record"]["files"]
    assert files[0].endswith(".tokens.zst") and files[-1].endswith(".json.zst")
    stored = read_document(Path(result["record"]["path"]))
    assert stored["capture"]["mode"] == "tokens" and stored["sidecars"]["tokens"]


@pytest.mark.parametrize("role", ["developer", "narrator"])
def test_a_role_the_template_drops_is_refused_before_inference(
    control: Control, scripted_engine: ScriptedEngine, role: str
) -> None:
    trajectory = control.create()
    client = openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )
    messages: list[Any] = [
        {"role": role, "content": "Always answer in French"},
        {"role": "user", "content": "x"},
    ]
    before = len(scripted_engine.requests)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="p", messages=messages)
    assert refused.value.status_code == 400
    assert refused.value.body["message"] == (
        f"message 0 (role '{role}') renders to no tokens with this chat template, so the "
        "model would never see it; send it with a role the template renders, such as 'system'"
    )
    assert len(scripted_engine.requests) == before
    document = control.document(trajectory["id"]).json()
    assert document["status"] == "open" and document["nodes"] == [] and document["failures"] == []
    # A normal conversation (an assistant turn of tool calls with empty content) is unaffected.
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    ordinary: list[Any] = [
        *START,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    assert client.chat.completions.create(model="p", messages=ordinary).choices
    nodes = control.document(trajectory["id"]).json()["nodes"]
    assert [n["message"] for n in nodes[:4]] == ordinary


def test_token_replies_are_replayed_to_retries(
    control: Control, scripted_engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    url = f"{trajectory['base_url']}/chat/completions"
    body = {"model": "p", "messages": START}
    before = len(scripted_engine.requests)
    first = httpx.post(url, json=body, timeout=30)
    retry = httpx.post(url, json=body, headers={"x-stainless-retry-count": "1"}, timeout=30)
    assert first.status_code == retry.status_code == 200
    assert retry.content == first.content and first.headers["x-skycap-status"] == "ok"
    assert len(scripted_engine.requests) == before + 1
    assert control.document(trajectory["id"]).json()["retries"]["replayed"] == 1
    models = httpx.get(f"{trajectory['base_url']}/models")
    assert models.status_code == 200 and models.json()["object"] == "list"
    refused = httpx.post(url, json={"model": "p", "messages": START, "n": 3})
    assert refused.status_code == 400


def test_token_failures_count_in_healthz_and_rows_show_the_last_one(
    server: ServerThread, control: Control, scripted_engine: ScriptedEngine
) -> None:
    before = control.http.get("/healthz").json()["failures_total"]
    trajectory = control.create({"task": "faulty"})
    client = openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )
    scripted_engine.fail_next("http_500")
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="p", messages=START)
    scripted_engine.fail_next("not_json")
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="p", messages=START)
    assert control.http.get("/healthz").json()["failures_total"] == before + 2
    row = next(r for r in control.http.get("/trajectories").json() if r["id"] == trajectory["id"])
    assert row["failures"] == 2 and row["idle_s"] >= 0
    assert row["last_failure"]["message"].startswith("engine: the reply is not JSON")
    assert row["last_failure"]["at"] <= row["last_activity"]
    assert control.finish(trajectory["id"], annotations={"reward": 0}).status_code == 200
    # Gone from memory, but counted still, and listed among the recently ended.
    assert control.http.get("/healthz").json()["failures_total"] == before + 2
    ended = control.http.get("/trajectories", params={"ended": "recent"}).json()
    assert ended[0]["id"] == trajectory["id"] and ended[0]["status"] == "finished"
    assert ended[0]["failures"] == 2 and ended[0]["annotations"] == {"reward": 0}
    assert ended[0]["record"]["path"].endswith(f"{trajectory['id']}.json.zst")


def test_a_group_first_call_is_a_render_cache_hit_counted_in_healthz(
    server: ServerThread, control: Control
) -> None:
    task = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "group task"}]
    before = control.http.get("/healthz").json()
    prompts = []
    for _ in range(3):
        trajectory = control.create()
        client = openai.OpenAI(
            base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
        )
        prompts.append(client.chat.completions.create(model="p", messages=task).usage)
    after = control.http.get("/healthz").json()
    assert after["render_cache_hits"] - before["render_cache_hits"] == 2
    assert after["render_cache_misses"] - before["render_cache_misses"] == 1
    assert after["render_cache_bytes"] > before["render_cache_bytes"]
    assert len({p.prompt_tokens for p in prompts}) == 1

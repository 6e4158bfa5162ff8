"""Token mode end to end: the unchanged openai SDK through the real server to a scripted engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from server_fixtures import Control, ServerThread, TextScript

from skycap.arrays import unpack
from skycap.cli.main import main as skycap_main
from skycap.mock.engine import ScriptedEngine
from skycap.mock.engine_wire import scripted_experts, scripted_logprob
from skycap.server.options import ServerOptions

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]
START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "find x"}]
TOOL_TURNS = 19
LAYERS, TOP_K = 4, 2


class Script(TextScript):
    """Thinking and a tool call until the prompt holds TOOL_TURNS tool results, then an answer."""

    def text(self, prompt: list[int]) -> str:
        done = prompt.count(self.tool_response)
        if done < TOOL_TURNS:
            args = json.dumps({"query": f"step {done}"})
            return (
                f"<think>\nStep {done}: search again.\n</think>\n\n"
                f'<tool_call>\n{{"name": "search", "arguments": {args}}}\n</tool_call>'
            )
        return f"<think>\nI have {done} results.\n</think>\n\nThe answer is 42."


@pytest.fixture(scope="module")
def script(qwen3_tokenizer: Any) -> Script:
    return Script(qwen3_tokenizer)


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer: Any, script: Script) -> Iterator[ScriptedEngine]:
    scripted = ScriptedEngine(
        qwen3_tokenizer, script=script, experts=(LAYERS, TOP_K), sampling_mask=True
    )
    with scripted:
        yield scripted


class OneServer:
    """At most one capture server at a time: mitmproxy's context is process-global.

    Tests asking for the same configuration share the running server; another
    configuration stops it first. Tests are ordered so each configuration starts once.
    The main configuration loads the tokenizer from its folder with two renderer slots, as
    `skycap serve --tokenizer` does; the others reuse the session's renderer.
    """

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.thread: ServerThread | None = None

    def get(self, upstream: str, **options: Any) -> ServerThread:
        key = (upstream, *sorted(options.items()))
        if key != self.key:
            self.stop()
            self.thread = ServerThread(ServerOptions(upstream, mode="tokens", **options))
            self.thread.start()
            self.key = key
        assert self.thread is not None
        return self.thread

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()
        self.thread, self.key = None, None


@pytest.fixture(scope="module")
def servers() -> Iterator[OneServer]:
    one = OneServer()
    yield one
    one.stop()


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("token-records")


@pytest.fixture
def control(
    servers: OneServer, engine: ScriptedEngine, records: Path, qwen3_dir: Path
) -> Iterator[Control]:
    """A control client of the main server: parsed replies, records, a 1 s engine timeout."""
    server = servers.get(
        engine.url,
        tokenizer=str(qwen3_dir),
        renderer_name="qwen3",
        renderer_pool_size=2,
        record_dir=records,
        upstream_timeout=1.0,
        sampling_mask=True,  # the engine runs as with --return-sampling-mask: top_k > 0
        sampling_overrides={"top_k": 20},
    )
    client = Control(server.url)
    yield client
    client.close()


def sdk(trajectory: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )


def session_requests(engine: ScriptedEngine, trajectory_id: str) -> list[Any]:
    return [
        r
        for r in engine.requests
        if r.method == "POST" and r.headers.get("X-Session-ID") == trajectory_id
    ]


def test_twenty_tool_turns_replayed_as_returned_stay_one_bridged_path(
    control: Control, engine: ScriptedEngine, script: Script
) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    messages: list[Any] = [dict(m) for m in START]
    for _ in range(TOOL_TURNS + 1):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message.model_dump()  # exactly as returned
        assert message["reasoning_content"]
        messages.append(message)
        for call in message["tool_calls"] or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == "The answer is 42."

    document = control.document(trajectory["id"]).json()
    calls = [c for n in document["nodes"] for c in n["calls"]]
    assert [c["bridged"] for c in calls] == [None] + [True] * TOOL_TURNS
    finished = control.finish(trajectory["id"]).json()
    assert finished["status"] == "finished" and finished["unbridged_calls"] == 0
    (sample,) = finished["samples"]
    requests = session_requests(engine, trajectory["id"])
    assert len(requests) == TOOL_TURNS + 1
    check_token_exactness(sample, requests, script)


def check_token_exactness(sample: dict[str, Any], requests: list[Any], script: Script) -> None:
    """input_ids, loss_mask, logprobs, experts and masks against what the engine saw."""
    input_ids = sample["input_ids"]
    prompts = [r.body["token_ids"] for r in requests]
    completions = [script.completion(p) for p in prompts]
    assert input_ids == prompts[-1] + completions[-1]
    mask = np.zeros(len(input_ids), dtype=int)
    logprobs = np.zeros(len(input_ids))
    mask_rows: list[list[int]] = [[] for _ in input_ids]
    for prompt, completion in zip(prompts, completions, strict=True):
        assert input_ids[len(prompt) : len(prompt) + len(completion)] == completion
        for i, token in enumerate(completion):
            position = len(prompt) + i
            mask[position] = 1
            logprobs[position] = scripted_logprob(token, position)
            mask_rows[position] = [token, token + 1]
    assert sample["loss_mask"] == mask.tolist()
    assert sample["logprobs"] == logprobs.tolist()
    experts = unpack(sample["routed_experts"])
    expected = scripted_experts(input_ids, 0, LAYERS, TOP_K)
    assert experts.shape == (len(input_ids), LAYERS, TOP_K)
    assert np.array_equal(experts[:-1], expected)  # every placeholder was replaced
    assert np.array_equal(experts[-1], expected[-1])  # the leaf's final row is a copy
    csr = sample["sampling_mask"]
    rows = [csr["ids"][a:b] for a, b in zip(csr["offsets"], csr["offsets"][1:], strict=False)]
    assert rows == mask_rows


def test_dropped_reasoning_forks_and_check_names_an_edited_reply(
    control: Control, records: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    messages: list[Any] = [dict(m) for m in START]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message.model_dump(exclude_none=True)
        del message["reasoning_content"], message["reasoning"]
        messages.append(message)
        messages.append(
            {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "42"}
        )
    finished = control.finish(trajectory["id"]).json()
    assert finished["unbridged_calls"] == 1 and len(finished["samples"]) == 2
    code = skycap_main(["check", str(records), trajectory["id"]])
    out = capsys.readouterr().out
    assert code == 1
    assert (
        "edited reply: the harness sent back the model's reply with reasoning_content dropped"
    ) in out
    assert "1 unbridged call(s)" in out


@pytest.mark.parametrize(
    ("fault", "status", "error"),
    [
        ("no_choices", 502, "engine: expected exactly one choice"),
        ("empty_token_ids", 502, "engine: completion token ids are missing or empty"),
        ("no_logprobs", 502, "engine: the engine returned no sampled-token logprobs"),
        ("short_logprobs", 502, "engine: "),
        ("not_json", 502, "engine: the reply is not JSON"),
        ("http_500", 500, "scripted engine fault http_500"),
        ("hang", 502, "engine: timed out after 1 s"),
    ],
)
def test_bad_engine_replies_answer_an_error_and_keep_the_trajectory_open(
    control: Control, engine: ScriptedEngine, fault: str, status: int, error: str
) -> None:
    trajectory = control.create()
    engine.fail_next(fault)
    with pytest.raises(openai.APIStatusError) as raised:
        sdk(trajectory).chat.completions.create(model="policy", messages=START, tools=TOOLS)
    engine.release()
    assert raised.value.status_code == status
    document = control.document(trajectory["id"]).json()
    assert document["status"] == "open" and document["nodes"] == []
    (failure,) = document["failures"]
    assert error in failure["error"]
    reply = sdk(trajectory).chat.completions.create(model="policy", messages=START, tools=TOOLS)
    assert reply.choices[0].message.tool_calls  # the next call works


@pytest.mark.parametrize("fault", ["experts_rank", "experts_coverage"])
def test_bad_routed_experts_fail_the_trajectory_after_answering(
    control: Control, engine: ScriptedEngine, fault: str
) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    engine.fail_next(fault)
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=START, tools=TOOLS
    )
    assert raw.headers["x-skycap-status"] == "failed"
    assert raw.parse().choices[0].message.tool_calls
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model="policy", messages=START, tools=TOOLS)
    assert raised.value.status_code == 410 and raised.value.code == "trajectory_closed"
    document = control.document(trajectory["id"]).json()
    assert document["status"] == "failed" and document["nodes"] == []
    assert document["failures"][0]["error"].startswith("token attribution: routed experts cover")
    finished = control.finish(trajectory["id"]).json()
    assert finished["status"] == "failed" and finished["samples"] == []


def test_raw_content_replayed_without_reasoning_stays_one_path(
    engine: ScriptedEngine, servers: OneServer, qwen3_renderer: Any
) -> None:
    server = servers.get(
        engine.url,
        renderer=qwen3_renderer,
        use_raw_content=True,
        sampling_overrides={"top_k": 20},  # the engine serves sampling masks
    )
    control = Control(server.url)
    try:
        trajectory = control.create()
        client = sdk(trajectory)
        messages: list[Any] = [dict(m) for m in START]
        for _ in range(4):
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            assert message.content.startswith("<think>") and "<tool_call>" in message.content
            assert message.model_dump()["reasoning_content"] is None
            messages.append({"role": "assistant", "content": message.content})
            messages.append({"role": "user", "content": "go on"})
        document = control.document(trajectory["id"]).json()
        calls = [c for n in document["nodes"] for c in n["calls"]]
        assert [c["bridged"] for c in calls] == [None, True, True, True]
        parents = [n["parent"] for n in document["nodes"]]
        assert len(set(parents)) == len(parents)  # no node has two children
    finally:
        control.close()


def test_an_unreachable_engine_answers_502(servers: OneServer, qwen3_renderer: Any) -> None:
    control = Control(servers.get("http://127.0.0.1:9", renderer=qwen3_renderer).url)
    try:
        trajectory = control.create()
        with pytest.raises(openai.APIStatusError) as raised:
            sdk(trajectory).chat.completions.create(model="policy", messages=START)
        assert raised.value.status_code == 502
        document = control.document(trajectory["id"]).json()
        assert document["status"] == "open"
        assert document["failures"][0]["error"].startswith("engine: ConnectError")
    finally:
        control.close()


def test_the_sdk_stream_helpers_replayed_messages_stay_one_bridged_path(
    control: Control,
) -> None:
    """`chat.completions.stream()`'s final message carries `parsed`, tool-call `index` and
    `parsed_arguments`, plus `reasoning`; replayed with model_dump() they fold away."""
    trajectory = control.create()
    client = sdk(trajectory)
    messages: list[Any] = [dict(m) for m in START]
    dumped: list[dict[str, Any]] = []
    for _ in range(3):
        with client.chat.completions.stream(
            model="policy", messages=messages, tools=TOOLS
        ) as stream:
            final = stream.get_final_completion()
        message = final.choices[0].message.model_dump()
        dumped.append(message)
        messages.append(message)
        for call in message["tool_calls"] or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
    assert "parsed" in dumped[0] and "index" in dumped[0]["tool_calls"][0]
    assert dumped[0]["reasoning"] == dumped[0]["reasoning_content"]
    document = control.document(trajectory["id"]).json()
    calls = [c for n in document["nodes"] for c in n["calls"]]
    assert [c["bridged"] for c in calls] == [None, True, True]
    assert {c["dialect"] for c in calls} == {"chat"}
    stored = [n["message"] for n in document["nodes"] if n["author"] == "model"]
    assert all("parsed" not in m and "reasoning" not in m for m in stored)
    finished = control.finish(trajectory["id"]).json()
    assert len(finished["samples"]) == 1 and finished["unbridged_calls"] == 0

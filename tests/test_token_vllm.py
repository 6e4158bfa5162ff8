"""Token mode against vLLM as it really is: the unchanged openai SDK, the real server, and the
scripted engine speaking vLLM 0.33's and 0.26's reply shapes and refusing what 0.33 refuses."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from server_fixtures import Control, ServerThread

from skycap import load
from skycap.arrays import unpack
from skycap.cli.main import main as skycap_main
from skycap.mock.engine import Reply, ScriptedEngine
from skycap.mock.engine_wire import scripted_experts
from skycap.server.options import ServerOptions

SERVED = "served-policy"
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
START = [{"role": "user", "content": "find x"}]
#: The model's sampling defaults, as a model folder's generation_config.json carries them.
GENERATION = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64}


@pytest.fixture(scope="module", params=["0.33", "0.26"])
def engine(request: pytest.FixtureRequest, qwen3_tokenizer: Any) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer, model=SERVED, version=request.param) as scripted:
        yield scripted


@pytest.fixture(scope="module")
def generation_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "generation_config.json"
    path.write_text(json.dumps({**GENERATION, "do_sample": True, "eos_token_id": [151645]}))
    return path


@pytest.fixture(scope="module")
def server(
    engine: ScriptedEngine,
    qwen3_renderer: Any,
    generation_config: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerThread]:
    """A token-mode server with no --model: it learns the engine's served name."""
    options = ServerOptions(
        engine.url,
        mode="tokens",
        renderer=qwen3_renderer,
        record_dir=tmp_path_factory.mktemp("records"),
        generation_config=str(generation_config),
    )
    with ServerThread(options) as running:
        yield running


@pytest.fixture
def control(server: ServerThread) -> Iterator[Control]:
    with Control(server.url) as client:
        yield client


def sdk(trajectory: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
    )


def calls_of(control: Control, trajectory_id: str) -> list[dict[str, Any]]:
    document = control.document(trajectory_id).json()
    return [c for n in document["nodes"] for c in n["calls"]]


def test_the_served_name_is_learned_and_the_harness_name_never_sent(
    engine: ScriptedEngine, control: Control
) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    reply = client.chat.completions.create(model="gpt-4o", messages=START)
    assert reply.choices[0].message.content
    assert engine.generated[-1].body["model"] == SERVED
    (call,) = calls_of(control, trajectory["id"])
    assert call["model"] == SERVED
    assert [m.id for m in client.models.list()] == [SERVED]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"temperature": 3}, "temperature", "temperature must be in [0, 2], got 3"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
        ({"presence_penalty": -3}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        (
            {"max_tokens": 5, "extra_body": {"min_tokens": 9}},
            "min_tokens",
            "min_tokens must be at most max_tokens=5, got 9",
        ),
        ({"extra_body": {"top_k": -2}}, "top_k", "top_k must be 0 (disable), or at least 1"),
        ({"extra_body": {"cache_salt": "a/b"}}, "cache_salt", "must not contain '@', '/'"),
        ({"extra_body": {"cache_salt": "s" * 129}}, "cache_salt", "at most 128 characters"),
        ({"extra_body": {"cache_salt": ""}}, "cache_salt", "non-empty string"),
        ({"stop": ["ok", ""]}, "stop", "stop cannot contain an empty string"),
    ],
)
def test_what_vllm_refuses_is_a_400_naming_the_field_before_the_engine(
    engine: ScriptedEngine, control: Control, extra: dict[str, Any], param: str, message: str
) -> None:
    trajectory = control.create()
    before = len(engine.generated)
    with pytest.raises(openai.BadRequestError) as raised:
        sdk(trajectory).chat.completions.create(model="p", messages=START, **extra)
    assert raised.value.param == param and message in raised.value.message
    assert len(engine.generated) == before
    document = control.document(trajectory["id"]).json()
    assert document["nodes"] == [] and document["failures"] == []


def test_a_good_cache_salt_reaches_the_engine(engine: ScriptedEngine, control: Control) -> None:
    trajectory = control.create()
    salt = "A" * 128
    sdk(trajectory).chat.completions.create(
        model="p", messages=START, extra_body={"cache_salt": salt}
    )
    assert engine.generated[-1].body["cache_salt"] == salt


def test_generation_defaults_fill_what_the_harness_omits_and_are_recorded(
    engine: ScriptedEngine, control: Control
) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    client.chat.completions.create(model="p", messages=START)
    sent = engine.generated[-1].body["sampling_params"]
    assert {k: sent[k] for k in ("temperature", "top_p", "top_k", "max_tokens")} == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "max_tokens": 64,
    }
    client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "other"}], temperature=0.2
    )
    assert engine.generated[-1].body["sampling_params"]["temperature"] == 0.2
    first, second = calls_of(control, trajectory["id"])
    assert first["sampling"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert second["sampling"]["temperature"] == 0.2 and second["sampling"]["top_k"] == 20


def test_a_stop_string_cuts_tokens_content_and_side_channels(
    engine: ScriptedEngine, control: Control, qwen3_tokenizer: Any
) -> None:
    trajectory = control.create()
    engine.queue("<think>\nok\n</think>\n\nThe answer is 42. DONE and then more text")
    reply = sdk(trajectory).chat.completions.create(model="p", messages=START, stop=["DONE", "42"])
    choice = reply.choices[0]
    assert choice.message.content == "The answer is "
    assert choice.finish_reason == "stop"
    request = engine.generated[-1].body
    assert "stop" not in request["sampling_params"]  # never forwarded
    (call,) = calls_of(control, trajectory["id"])
    assert call["stop_string"] == "42" and call["finish_reason"] == "stop"
    assert call["sampling"]["stop"] == ["DONE", "42"]
    finished = control.finish(trajectory["id"]).json()
    (sample,) = finished["samples"]
    prompt = request["token_ids"]
    sampled = sample["input_ids"][len(prompt) :]
    text = qwen3_tokenizer.decode(sampled)
    assert text.endswith("42") and "DONE" not in text  # through the token completing "42"
    assert call["usage"]["completion_tokens"] == len(sampled)
    assert sample["loss_mask"][len(prompt) :] == [1] * len(sampled)
    rows = unpack(sample["routed_experts"])
    assert rows.shape[0] == len(sample["input_ids"])
    assert np.array_equal(rows[:-1], scripted_experts(sample["input_ids"], 0, 4, 2))


def test_the_stop_string_answer_replays_as_one_path(
    control: Control, engine: ScriptedEngine
) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    engine.queue("Hello there. END ignored", "Fine.")
    messages: list[Any] = [dict(m) for m in START]
    first = client.chat.completions.create(model="p", messages=messages, stop="END")
    assert first.choices[0].message.content == "Hello there. "
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "user", "content": "more"}]
    client.chat.completions.create(model="p", messages=messages)
    document = control.document(trajectory["id"]).json()
    parents = [n["parent"] for n in document["nodes"]]
    assert len(set(parents)) == len(parents)  # one path: no node has two children


def test_missing_logprobs_are_nan_in_the_record_and_never_trained(
    engine: ScriptedEngine, control: Control, server: ServerThread
) -> None:
    trajectory = control.create()
    engine.fail_next("missing_logprobs")
    engine.queue("Two words.")
    sdk(trajectory).chat.completions.create(model="p", messages=START)
    (call,) = calls_of(control, trajectory["id"])
    assert call["missing_logprobs"] == 1
    finished = control.finish(trajectory["id"]).json()
    (sample,) = finished["samples"]
    prompt = len(engine.generated[-1].body["token_ids"])
    assert sample["loss_mask"][prompt] == 0 and sample["logprobs"][prompt] == 0.0
    assert sample["loss_mask"][prompt + 1 :] == [1] * (len(sample["input_ids"]) - prompt - 1)
    loaded = load(server.options.record_dir, trajectory["id"])
    node = next(n for n in loaded.trajectory.graph if n.is_model)
    assert math.isnan(node.tokens.logprobs[node.tokens.sampled_start])
    (again,) = loaded.samples("all")
    assert again.loss_mask == sample["loss_mask"]
    # The record checker accepts a NaN sampled logprob (format: NaN is "no logprob").
    assert skycap_main(["validate", str(server.options.record_dir)]) == 0


def test_repetition_is_a_normal_stop_and_abort_an_engine_failure(
    engine: ScriptedEngine, control: Control
) -> None:
    trajectory = control.create()
    client = sdk(trajectory)
    engine.queue(Reply("again again again", "repetition"))
    reply = client.chat.completions.create(model="p", messages=START)
    assert reply.choices[0].finish_reason == "stop"
    (call,) = calls_of(control, trajectory["id"])
    assert call["engine_finish_reason"] == "repetition"
    engine.queue(Reply("half", "abort"))
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "b"}])
    assert raised.value.status_code == 502 and "'abort'" in raised.value.message
    document = control.document(trajectory["id"]).json()
    assert len(calls_of(control, trajectory["id"])) == 1 and document["status"] == "open"
    assert "'abort'" in document["failures"][-1]["error"]


def test_usage_chunk_only_with_include_usage(control: Control) -> None:
    client = sdk(control.create())
    plain = list(client.chat.completions.create(model="p", messages=START, stream=True))
    assert all(chunk.usage is None for chunk in plain) and plain[-1].choices
    counted = list(
        client.chat.completions.create(
            model="p", messages=START, stream=True, stream_options={"include_usage": True}
        )
    )
    assert counted[-1].choices == [] and counted[-1].usage.total_tokens > 0
    assert all(chunk.usage is None for chunk in counted[:-1])
    assert counted[-2].choices[0].finish_reason == "stop"


def test_a_forced_named_tool_finishes_stop_and_tool_choice_is_recorded(
    control: Control,
) -> None:
    trajectory = control.create()
    choice = {"type": "function", "function": {"name": "search"}}
    reply = sdk(trajectory).chat.completions.create(
        model="p", messages=START, tools=TOOLS, tool_choice=choice
    )
    assert reply.choices[0].message.tool_calls[0].function.name == "search"
    assert reply.choices[0].finish_reason == "stop"
    (call,) = calls_of(control, trajectory["id"])
    assert call["tool_choice"] == choice and call["finish_reason"] == "stop"


def test_int32_experts_are_stored_narrowed(
    engine: ScriptedEngine, control: Control, server: ServerThread
) -> None:
    trajectory = control.create()
    engine.experts_dtype = "int32"  # older builds send int32 rows
    try:
        sdk(trajectory).chat.completions.create(model="p", messages=START)
    finally:
        engine.experts_dtype = "uint8"
    control.finish(trajectory["id"])
    (sample,) = load(server.options.record_dir, trajectory["id"]).samples("all")
    assert sample.routed_experts.dtype == np.uint16
    expected = scripted_experts(sample.input_ids, 0, 4, 2)
    assert np.array_equal(sample.routed_experts[:-1], expected)

"""Tests of TokenBackend.call driven directly against the scripted vLLM engine on a real socket."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from skycap.dialects.chat import DIALECT as CHAT
from skycap.mock.engine import Reply as EngineReply
from skycap.mock.engine import ScriptedEngine
from skycap.mock.engine_wire import scripted_experts, scripted_logprob
from skycap.tokens.backend import TokenBackend
from skycap.tokens.client import ENGINE_EXCERPT_LIMIT, engine_status_message
from skycap.tokens.engine import VLLMEngine
from skycap.tokens.library_renderer import LibraryRenderer
from skycap.tokens.renderer import _SHARED_INTS, SHARED_INT_LIMIT
from skycap.tokens.renderer import interned as _interned
from skycap.trajectory import FAILED, FINISHED, Trajectory

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


@pytest.fixture
def engine(qwen3_tokenizer: Any) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer, model=["scripted-policy", "served-policy"]) as scripted:
        yield scripted


@pytest.fixture
async def make_backend(
    engine: ScriptedEngine, qwen3_renderer: LibraryRenderer
) -> AsyncIterator[Any]:
    made: list[TokenBackend] = []

    def make(**options: Any) -> TokenBackend:
        options.setdefault("upstream_url", engine.url)
        if "tokenizer" not in options:
            options.setdefault("renderer", qwen3_renderer)
        backend = TokenBackend(**options)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.close()


def trajectory(backend: TokenBackend, suffix: str = "01") -> Trajectory:
    return Trajectory("tr_00000000000000" + suffix, capture=backend.capture)


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": messages, "tools": TOOLS, **extra}


def answer(reply: Any) -> dict[str, Any]:
    assert reply.status == 200, reply.body
    return json.loads(reply.body)


def error_of(reply: Any) -> dict[str, Any]:
    return json.loads(reply.body)["error"]


async def run_episode(backend: TokenBackend, traj: Trajectory, turns: int) -> list[dict[str, Any]]:
    """A harness loop: replay each reply as returned, answer tool calls, then ask again."""
    messages = [dict(m) for m in START]
    for _ in range(turns):
        message = answer(await backend.call(traj, CHAT.read(chat_body(messages)), CHAT))["choices"][
            0
        ]["message"]
        messages.append(message)
        for call in message.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": "and again?"})
    return messages


async def test_a_tool_episode_stays_one_path_and_every_later_call_bridges(
    engine: ScriptedEngine, make_backend: Any
) -> None:
    engine.sampling_mask = True  # as started with --return-sampling-mask: top_k is required
    backend = make_backend(sampling_mask=True, sampling_overrides={"top_k": 20})
    traj = trajectory(backend)
    await run_episode(backend, traj, 4)
    graph = traj.graph
    assert len(graph.leaves()) == 1
    calls = list(graph.calls())
    assert [c["bridged"] for c in calls] == [None, True, True, True]
    assert all(c["finish_reason"] in ("tool_calls", "stop") for c in calls)
    assert calls[0]["finish_reason"] == "tool_calls"
    generate = [r for r in engine.requests if r.method == "POST"]
    assert all(r.headers["X-Session-ID"] == traj.id for r in generate)
    assert "Authorization" not in generate[0].headers
    # Token exactness: each call's model node path is exactly prompt + completion it saw.
    model_nodes = [n for n in graph if n.is_model]
    for node, request in zip(model_nodes, generate, strict=True):
        path = graph.path_to(node.id)
        sequence = np.concatenate([graph[i].tokens.ids for i in path]).tolist()
        prompt = request.body["token_ids"]
        assert sequence[: len(prompt)] == prompt
        assert node.calls[0]["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(sequence) - len(prompt),
        }
        sampled = node.tokens.ids[node.tokens.sampled_start :].tolist()
        assert node.tokens.logprobs[node.tokens.sampled_start :].tolist() == [
            scripted_logprob(t, len(prompt) + i) for i, t in enumerate(sampled)
        ]
        assert node.tokens.mask_row_lists() == [[t, t + 1] for t in sampled]
    # Routed experts line up with positions; only the leaf keeps a placeholder row.
    leaf_path = graph.path_to(graph.leaves()[0])
    rows = np.concatenate([graph[i].tokens.experts for i in leaf_path])
    sequence = np.concatenate([graph[i].tokens.ids for i in leaf_path]).tolist()
    expected = scripted_experts(sequence, 0, 4, 2)
    assert np.array_equal(rows[:-1], expected) and np.array_equal(rows[-1], expected[-1])
    assert [graph[i].tokens.experts_placeholder for i in leaf_path].count(True) == 1
    assert "routed_experts_prompt_start" not in generate[0].body["sampling_params"]
    for previous, request in zip(calls, generate[1:], strict=False):
        reused = previous["usage"]["prompt_tokens"] + previous["usage"]["completion_tokens"]
        assert request.body["sampling_params"]["routed_experts_prompt_start"] == reused - 1


async def test_sampling_merge_clamp_and_recording(
    engine: ScriptedEngine, make_backend: Any
) -> None:
    backend = make_backend(
        sampling_overrides={"top_k": 20, "max_completion_tokens": 500},
        max_model_len=10000,
        model="served-policy",
        api_key="sk-engine",
    )
    traj = trajectory(backend)
    body = chat_body(START, temperature=0.7, max_tokens=50, seed=None, cache_salt="salt")
    answer(await backend.call(traj, CHAT.read(body), CHAT))
    sent = engine.requests[-1].body
    params = sent["sampling_params"]
    assert params["temperature"] == 0.7 and params["top_k"] == 20 and params["logprobs"] == 0
    assert params["max_tokens"] == 500  # the override's folded max_completion_tokens wins
    assert params["stop_token_ids"] == [151645, 151643] and "seed" not in params
    assert sent["model"] == "served-policy" and sent["cache_salt"] == "salt"
    assert engine.requests[-1].headers["Authorization"] == "Bearer sk-engine"
    (call,) = traj.graph.calls()
    assert call["sampling"] == {"temperature": 0.7, "max_tokens": 500, "top_k": 20}
    assert call["model"] == "served-policy"


async def test_max_tokens_is_clamped_to_the_room_left(
    engine: ScriptedEngine, make_backend: Any
) -> None:
    backend = make_backend(max_model_len=200)
    traj = trajectory(backend)
    answer(await backend.call(traj, CHAT.read(chat_body(START, max_tokens=5000)), CHAT))
    prompt = len(engine.requests[-1].body["token_ids"])
    assert engine.requests[-1].body["sampling_params"]["max_tokens"] == 200 - prompt


@pytest.mark.parametrize(
    ("extra", "options", "status", "code", "message"),
    [
        ({"max_prompt_tokens": -1}, {}, 400, None, "non-negative integer, got -1"),
        ({"max_prompt_tokens": True}, {}, 400, None, "non-negative integer, got True"),
        (
            {"max_prompt_tokens": 10},
            {},
            400,
            "context_length_exceeded",
            "exceeds max_prompt_tokens=10",
        ),
        (
            {},
            {"max_model_len": 20},
            400,
            "context_length_exceeded",
            "leaves no room within max_model_len=20",
        ),
        (
            {"max_tokens": "many"},
            {"max_model_len": 5000},
            400,
            None,
            "max_tokens must be an integer",
        ),
    ],
)
async def test_refusals_before_inference_record_nothing(
    engine: ScriptedEngine,
    make_backend: Any,
    extra: dict[str, Any],
    options: dict[str, Any],
    status: int,
    code: str | None,
    message: str,
) -> None:
    backend = make_backend(**options)
    traj = trajectory(backend)
    reply = await backend.call(traj, CHAT.read(chat_body(START, **extra)), CHAT)
    assert reply.status == status and not reply.replayable
    assert error_of(reply)["code"] == code and message in error_of(reply)["message"]
    assert engine.generated == [] and len(traj.graph) == 0 and traj.failures == [] and traj.is_open
    assert traj.context_length_exceeded is (code == "context_length_exceeded")


async def test_plan_errors_are_400_before_inference(
    engine: ScriptedEngine, make_backend: Any
) -> None:
    backend = make_backend()
    traj = trajectory(backend)
    reply = await backend.call(traj, CHAT.read(chat_body([])), CHAT)
    assert reply.status == 400 and "`messages` is empty" in error_of(reply)["message"]
    reply = await backend.call(traj, CHAT.read(chat_body([{"content": "no role"}])), CHAT)
    assert reply.status == 400 and error_of(reply)["type"] == "invalid_request_error"
    assert engine.generated == [] and traj.failures == [] and traj.is_open


@pytest.mark.parametrize("role", ["developer", "narrator"])
async def test_a_message_the_template_drops_is_a_plan_error_naming_it(
    engine: ScriptedEngine, make_backend: Any, role: str
) -> None:
    backend = make_backend()
    traj = trajectory(backend)
    dropped = {"role": role, "content": "Always answer in French"}
    reply = await backend.call(
        traj, CHAT.read(chat_body([dropped, {"role": "user", "content": "x"}])), CHAT
    )
    assert reply.status == 400 and error_of(reply)["code"] is None
    assert error_of(reply)["message"] == (
        f"message 0 (role '{role}') renders to no tokens with this chat template, so the "
        "model would never see it; send it with a role the template renders, such as 'system'"
    )
    assert engine.generated == [] and len(traj.graph) == 0 and traj.failures == [] and traj.is_open
    # Later in the history, where the turn would bridge: refused the same way, by position.
    messages = await run_episode(backend, traj, 1)
    nodes, requests = len(traj.graph), len(engine.generated)
    later = [*messages, dropped, {"role": "user", "content": "y"}]
    reply = await backend.call(traj, CHAT.read(chat_body(later)), CHAT)
    assert reply.status == 400
    assert error_of(reply)["message"].startswith(f"message {len(messages)} (role '{role}')")
    assert len(traj.graph) == nodes and len(engine.generated) == requests and traj.failures == []


async def test_messages_with_nothing_to_render_may_get_no_tokens(make_backend: Any) -> None:
    backend = make_backend()
    traj = trajectory(backend)
    empty = [{"role": "developer", "content": ""}, {"role": "user", "content": "x"}]
    answer(await backend.call(traj, CHAT.read(chat_body(empty)), CHAT))
    first = traj.graph[0]
    assert first.message == empty[0] and first.tokens.length == 0
    assert traj.graph[1].tokens.length > 0


async def test_an_ordinary_tool_conversation_renders_every_message(make_backend: Any) -> None:
    backend = make_backend()
    traj = trajectory(backend)
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    messages = [
        *START,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    answer(await backend.call(traj, CHAT.read(chat_body(messages)), CHAT))
    clients = [node for node in traj.graph if not node.is_model]
    assert [node.message for node in clients] == messages
    assert all(node.tokens.length > 0 for node in clients)


async def test_stream_true_answers_one_buffered_sse_body(make_backend: Any) -> None:
    backend = make_backend()
    traj = trajectory(backend)
    body = chat_body(START, stream=True, stream_options={"include_usage": True})
    reply = await backend.call(traj, CHAT.read(body), CHAT)
    assert reply.status == 200 and reply.replayable
    assert reply.headers["content-type"] == "text/event-stream"
    assert reply.headers["x-skycap-status"] == "ok"
    frames = reply.body.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant"}
    reasoning = "Step 1: I will call search."
    assert deltas[1] == {"reasoning_content": reasoning, "reasoning": reasoning}
    assert deltas[2]["tool_calls"][0]["function"]["name"] == "search"
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    # Usage comes last, in a chunk of its own, only because include_usage asked for it.
    assert chunks[-1]["choices"] == [] and "usage" not in chunks[-2]
    assert chunks[-1]["usage"]["total_tokens"] == sum(
        chunks[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens")
    )
    plain = await backend.call(
        trajectory(backend, "02"), CHAT.read(chat_body(START, stream=True)), CHAT
    )
    frames = plain.body.decode().split("\n\n")
    assert all("usage" not in json.loads(f.removeprefix("data: ")) for f in frames[:-2])


async def test_raw_content_replays_verbatim_as_one_path(make_backend: Any) -> None:
    backend = make_backend(use_raw_content=True)
    traj = trajectory(backend)
    messages = [dict(m) for m in START]
    for _ in range(3):
        message = answer(await backend.call(traj, CHAT.read(chat_body(messages)), CHAT))["choices"][
            0
        ]
        assert message["finish_reason"] == "stop"  # tool calls are not parsed
        message = message["message"]
        assert message["reasoning_content"] is None and message["content"].startswith("<think>")
        messages.append({"role": "assistant", "content": message["content"]})
        messages.append({"role": "user", "content": "go on"})
    assert len(traj.graph.leaves()) == 1
    assert [c["bridged"] for c in traj.graph.calls()] == [None, True, True]
    stored = next(n for n in traj.graph if n.is_model).message
    assert set(stored) == {"role", "content"}


async def test_dropped_reasoning_forks_and_is_unbridged(make_backend: Any) -> None:
    backend = make_backend()
    traj = trajectory(backend)
    messages = [dict(m) for m in START]
    message = answer(await backend.call(traj, CHAT.read(chat_body(messages)), CHAT))["choices"][0][
        "message"
    ]
    del message["reasoning_content"], message["reasoning"]
    messages += [message, {"role": "tool", "tool_call_id": "c", "content": "42"}]
    answer(await backend.call(traj, CHAT.read(chat_body(messages)), CHAT))
    assert len(traj.graph.leaves()) == 2
    assert [c["bridged"] for c in traj.graph.calls()] == [None, False]


@pytest.mark.parametrize(
    ("fault", "status", "failure_status", "error"),
    [
        ("no_choices", 502, None, "engine: expected exactly one choice"),
        ("empty_token_ids", 502, None, "engine: completion token ids are missing or empty"),
        ("no_logprobs", 502, None, "engine: the engine returned no sampled-token logprobs"),
        ("short_logprobs", 502, None, "completion tokens but"),
        ("not_json", 502, None, "engine: the reply is not JSON"),
        ("http_500", 500, 500, "scripted engine fault http_500"),
        ("http_400", 502, 400, "scripted engine fault http_400"),
        ("close", 502, None, "engine: RemoteProtocolError"),
    ],
)
async def test_engine_failures_answer_502_and_keep_the_trajectory_open(
    engine: ScriptedEngine,
    make_backend: Any,
    fault: str,
    status: int,
    failure_status: int | None,
    error: str,
) -> None:
    backend = make_backend()
    traj = trajectory(backend)
    engine.fail_next(fault)
    reply = await backend.call(traj, CHAT.read(chat_body(START)), CHAT)
    assert reply.status == status and not reply.replayable
    assert error_of(reply)["type"] == "api_error"
    (failure,) = traj.failures
    assert failure["status"] == failure_status and error in failure["error"]
    assert traj.is_open and len(traj.graph) == 0
    answer(await backend.call(traj, CHAT.read(chat_body(START)), CHAT))  # the next call works


async def test_an_engine_error_status_quotes_the_engine_body(
    engine: ScriptedEngine, make_backend: Any
) -> None:
    backend = make_backend(upstream_url=engine.url + "/v1")  # the usual wrong root
    traj = trajectory(backend)
    reply = await backend.call(traj, CHAT.read(chat_body(START)), CHAT)
    body = '{"error":{"message":"no route /v1/inference/v1/generate"}}'
    assert reply.status == 502 and error_of(reply)["message"] == f"engine returned HTTP 404: {body}"
    assert traj.failures[0]["status"] == 404 and traj.failures[0]["error"] == body


def test_engine_status_messages_collapse_whitespace_and_cut_long_bodies() -> None:
    assert engine_status_message(503, "") == "engine returned HTTP 503"
    assert engine_status_message(400, " bad\n\t  value ") == "engine returned HTTP 400: bad value"
    long = engine_status_message(500, "x" * 5000)
    assert long == "engine returned HTTP 500: " + "x" * (ENGINE_EXCERPT_LIMIT - 1) + "…"


@pytest.mark.parametrize("fault", ["experts_rank", "experts_coverage"])
async def test_bad_experts_fail_the_trajectory_but_still_answer(
    engine: ScriptedEngine, make_backend: Any, fault: str
) -> None:
    backend = make_backend()
    traj = trajectory(backend)
    answer(await backend.call(traj, CHAT.read(chat_body(START)), CHAT))
    engine.fail_next(fault)
    messages = [*START, {"role": "user", "content": "more"}]
    reply = await backend.call(traj, CHAT.read(chat_body(messages)), CHAT)
    assert reply.status == 200 and reply.headers["x-skycap-status"] == "failed"
    assert not reply.replayable and answer(reply)["choices"][0]["message"]["role"] == "assistant"
    assert traj.status == FAILED and len(traj.graph) == 3  # only the first turn's nodes
    (failure,) = traj.failures
    assert failure["status"] is None
    assert failure["error"].startswith("token attribution: routed experts cover")
    later = await backend.call(traj, CHAT.read(chat_body(messages)), CHAT)
    assert later.status == 410 and error_of(later)["code"] == "trajectory_closed"
    assert error_of(later)["message"] == "trajectory is failed"


async def test_connection_refused_and_hang_past_the_timeout(
    engine: ScriptedEngine, make_backend: Any
) -> None:
    refused = make_backend(upstream_url="http://127.0.0.1:9")
    traj = trajectory(refused)
    reply = await refused.call(traj, CHAT.read(chat_body(START)), CHAT)
    assert reply.status == 502 and "engine: ConnectError" in error_of(reply)["message"]
    assert traj.failures[0]["error"].startswith("engine: ConnectError") and traj.is_open

    slow = make_backend(upstream_timeout=0.3)
    traj = trajectory(slow, "02")
    engine.fail_next("hang")
    reply = await slow.call(traj, CHAT.read(chat_body(START)), CHAT)
    engine.release()
    assert reply.status == 502
    assert error_of(reply)["message"] == "engine: timed out after 0.3 s"
    assert traj.failures[0]["error"] == "engine: timed out after 0.3 s" and traj.is_open


async def test_turns_of_one_trajectory_run_one_at_a_time_and_trajectories_in_parallel(
    engine: ScriptedEngine, make_backend: Any
) -> None:
    backend = make_backend()
    one, other = trajectory(backend, "01"), trajectory(backend, "02")
    engine.fail_next("hang")
    held = asyncio.create_task(backend.call(one, CHAT.read(chat_body(START)), CHAT))
    await asyncio.to_thread(engine.wait_for_requests, 1)
    queued = asyncio.create_task(backend.call(one, CHAT.read(chat_body(START)), CHAT))
    answer(
        await backend.call(other, CHAT.read(chat_body(START)), CHAT)
    )  # not blocked by the hung turn
    assert not held.done() and not queued.done()
    engine.release()
    answer(await held)
    answer(await queued)
    # The queued turn planned after the first committed: the graph was not empty then.
    assert [c["bridged"] for c in one.graph.calls()] == [None, False]
    assert len(one.graph) == 3 and len(one.graph[2].calls) == 2


async def test_a_closed_trajectory_gets_410(engine: ScriptedEngine, make_backend: Any) -> None:
    backend = make_backend()
    traj = trajectory(backend)
    traj.seal(FINISHED)
    reply = await backend.call(traj, CHAT.read(chat_body(START)), CHAT)
    assert reply.status == 410 and error_of(reply)["message"] == "trajectory is finished"
    assert engine.generated == []


async def test_models_lists_the_served_model_or_passes_the_engine_through(
    engine: ScriptedEngine, make_backend: Any
) -> None:
    named = await make_backend(model="served").models()
    assert json.loads(named.body)["data"] == [
        {"id": "served", "object": "model", "owned_by": "skycap"}
    ]
    passed = await make_backend().models()
    assert passed.status == 200 and json.loads(passed.body)["data"][0]["id"] == "scripted-policy"
    down = await make_backend(upstream_url="http://127.0.0.1:9").models()
    assert down.status == 502 and error_of(down)["type"] == "api_error"


async def test_release_posts_the_session_and_drops_turn_state(
    engine: ScriptedEngine, make_backend: Any
) -> None:
    class Releasing(VLLMEngine):
        release_path = "/release"

    backend = make_backend(engine=Releasing())
    traj = trajectory(backend)
    answer(await backend.call(traj, CHAT.read(chat_body(START)), CHAT))
    await backend.release(traj.id)  # the scripted engine answers 404: only logged
    assert engine.requests[-1].path == f"/release?session_id={traj.id}"
    assert traj.id not in backend._states


async def test_tokenizer_options_build_a_pool_and_decode_spans_is_thread_safe(
    make_backend: Any, qwen3_dir: Path
) -> None:
    backend = make_backend(tokenizer=str(qwen3_dir), renderer_name="qwen3", renderer_pool_size=2)
    assert backend.capture == {
        "mode": "tokens",
        "engine": "vllm",
        "tokenizer": str(qwen3_dir),
        "logprobs_mode": "processed_logprobs",
        "sampling_overrides": {},
        "use_raw_content": False,
    }
    traj = trajectory(backend)
    answer(await backend.call(traj, CHAT.read(chat_body(START)), CHAT))
    node = traj.graph[1]
    results = await asyncio.gather(
        *(asyncio.to_thread(backend.decode_spans, node.tokens.ids, ()) for _ in range(4))
    )
    text, offsets = results[0]
    assert all(r == results[0] for r in results)
    assert text.startswith(b"<|im_start|>user\nfind x") and len(offsets) == node.tokens.length


def test_from_options_reads_the_server_options(engine: ScriptedEngine, qwen3_renderer: Any) -> None:
    from skycap.server.options import ServerOptions

    options = ServerOptions(
        engine.url, mode="tokens", renderer=qwen3_renderer, use_raw_content=True
    )
    backend = TokenBackend.from_options(options)
    assert backend.capture["use_raw_content"] is True and backend.upstream_url == engine.url
    with pytest.raises(ValueError, match="exactly one of tokenizer"):
        TokenBackend(upstream_url=engine.url)


async def test_a_truncated_thinking_reply_bridges_with_the_close_as_scaffold(
    engine: ScriptedEngine, make_backend: Any
) -> None:
    backend = make_backend()
    traj = trajectory(backend)
    engine.queue(EngineReply("<think>\nstill thinking", finish_reason="length"))
    first = answer(await backend.call(traj, CHAT.read(chat_body(START)), CHAT))["choices"][0]
    assert first["finish_reason"] == "length"
    messages = [*START, first["message"], {"role": "user", "content": "finish"}]
    answer(await backend.call(traj, CHAT.read(chat_body(messages)), CHAT))
    assert [c["bridged"] for c in traj.graph.calls()] == [None, True]
    assert len(traj.graph.leaves()) == 1


def test_interned_lists_equal_their_input_above_the_table_limit_too() -> None:
    ids = [0, 5, 151645, SHARED_INT_LIMIT - 1, SHARED_INT_LIMIT, SHARED_INT_LIMIT + 7, 2**40, 3]
    for given in (ids, tuple(ids), np.asarray(ids, dtype=np.int64)):
        for start in (0, 3, len(ids)):
            out = _interned(given, start)
            assert type(out) is list and len(out) == len(ids) and out == ids
    assert _interned([], 0) == []
    # Equal ids below the limit become one shared object; the table never passes the limit.
    one, two = (_interned([int(str(151645)), int(str(SHARED_INT_LIMIT + 7))], 0) for _ in range(2))
    assert one[0] is two[0] and one == two == [151645, SHARED_INT_LIMIT + 7]
    assert len(_SHARED_INTS) == SHARED_INT_LIMIT

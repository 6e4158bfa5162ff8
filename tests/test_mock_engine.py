"""Tests of the scripted vLLM engine over a real socket, read back through the engine wire."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

from skycap.mock.engine import (
    FAULTS,
    GENERATE_PATH,
    Reply,
    ScriptedEngine,
    scripted_experts,
    scripted_logprob,
)
from skycap.tokens.engine import EngineError, VLLMEngine

WIRE = VLLMEngine()
IM_END = 151645
TOOLS_PROMPT = (
    "<|im_start|>system\n# Tools\n\n<tools>\n"
    '{"type": "function", "function": {"name": "lookup", "parameters": {}}}\n'
    "</tools><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture
def engine(qwen3_tokenizer) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer) as running:
        yield running


@pytest.fixture
def http(engine: ScriptedEngine) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=5) as client:
        yield client


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def generate(
    http: httpx.Client, prompt: list[int], *, routes_from: int = 0, **sampling: Any
) -> httpx.Response:
    body = WIRE.request(
        prompt_ids=prompt,
        sampling=sampling,
        model="policy",
        cache_salt=None,
        sampling_mask=False,
        routes_from=routes_from,
    )
    return http.post(GENERATE_PATH, json=body, headers={"X-Session-ID": "tr_0123456789abcdef"})


def test_scripted_reply_round_trips_through_the_wire(
    engine: ScriptedEngine, http: httpx.Client, qwen3_tokenizer
) -> None:
    text = "<think>\nok\n</think>\n\nHello 🦩."
    engine.queue(text)
    prompt = list(range(100, 120))
    response = generate(http, prompt, temperature=0.5)
    assert response.status_code == 200
    out = WIRE.parse(response.json())

    expected = encode(qwen3_tokenizer, text) + [IM_END]
    assert out.completion_ids == expected and out.finish_reason == "stop"
    assert out.logprobs == [scripted_logprob(t, 20 + i) for i, t in enumerate(expected)]
    total = len(prompt) + len(expected)
    assert out.routed_start == 0 and out.routed_experts.shape == (total - 1, 4, 2)
    assert np.array_equal(out.routed_experts, scripted_experts(prompt + expected, 0, 4, 2))
    assert out.sampling_mask is None

    seen = engine.requests[-1]
    assert seen.path == GENERATE_PATH and seen.body["token_ids"] == prompt
    assert seen.body["sampling_params"] == {"temperature": 0.5, "logprobs": 0}
    assert seen.headers["X-Session-ID"] == "tr_0123456789abcdef"
    assert response.json()["usage"] == {
        "prompt_tokens": 20,
        "completion_tokens": len(expected),
        "total_tokens": total,
    }


def test_experts_honour_the_prompt_start(engine: ScriptedEngine, http: httpx.Client) -> None:
    engine.queue("Fine.")
    prompt = list(range(200, 230))
    out = WIRE.parse(generate(http, prompt, routes_from=12).json(), routes_from=12)
    sequence = prompt + out.completion_ids
    assert out.routed_start == 12
    assert out.routed_experts.shape[0] == len(sequence) - 1 - 12
    assert np.array_equal(out.routed_experts, scripted_experts(sequence, 12, 4, 2))
    assert engine.requests[-1].body["sampling_params"]["routed_experts_prompt_start"] == 12


def test_length_replies_and_max_tokens_cut_without_a_stop_token(
    engine: ScriptedEngine, http: httpx.Client, qwen3_tokenizer
) -> None:
    engine.queue(Reply("<think>\nstill thinking", finish_reason="length"), "a long answer here")
    out = WIRE.parse(generate(http, [1, 2]).json())
    assert out.completion_ids == encode(qwen3_tokenizer, "<think>\nstill thinking")
    assert out.finish_reason == "length"
    out = WIRE.parse(generate(http, [1, 2], max_tokens=2).json())
    assert out.completion_ids == encode(qwen3_tokenizer, "a long answer here")[:2]
    assert out.finish_reason == "length" and IM_END not in out.completion_ids


def test_script_function_and_optional_side_channels(qwen3_tokenizer) -> None:
    seen: list[dict[str, Any]] = []

    def script(body: dict[str, Any]) -> str:
        seen.append(body)
        return f"{len(body['token_ids'])} tokens"

    with (
        ScriptedEngine(qwen3_tokenizer, script=script, experts=None, sampling_mask=True) as engine,
        httpx.Client(base_url=engine.url) as http,
    ):
        out = WIRE.parse(generate(http, [7, 8, 9]).json())
    assert out.completion_ids == encode(qwen3_tokenizer, "3 tokens") + [IM_END]
    assert out.routed_experts is None
    assert out.sampling_mask == [[t, t + 1] for t in out.completion_ids]
    assert seen[0]["token_ids"] == [7, 8, 9]


def test_default_script_calls_the_offered_tool_twice_then_answers(
    engine: ScriptedEngine, http: httpx.Client, qwen3_tokenizer
) -> None:
    prompt = encode(qwen3_tokenizer, TOOLS_PROMPT)
    result = encode(qwen3_tokenizer, "<tool_response>\nok\n</tool_response>")
    texts = []
    for results in range(3):
        out = WIRE.parse(generate(http, prompt + result * results).json())
        texts.append(qwen3_tokenizer.decode(out.completion_ids))
    assert '<tool_call>\n{"name": "lookup", "arguments": {"query": "step 1"}}' in texts[0]
    assert '"arguments": {"query": "step 2"}' in texts[1]
    assert "<tool_call>" not in texts[2] and texts[2].startswith("<think>\n")
    assert texts[2].endswith("<|im_end|>")
    again = WIRE.parse(generate(http, prompt).json())
    assert qwen3_tokenizer.decode(again.completion_ids) == texts[0]


def test_models_route_and_unknown_routes(engine: ScriptedEngine, http: httpx.Client) -> None:
    models = http.get("/v1/models")
    assert models.status_code == 200
    assert models.json()["data"][0]["id"] == "scripted-policy"
    assert http.post("/v1/chat/completions", json={}).status_code == 404


def test_bad_requests_get_400(engine: ScriptedEngine, http: httpx.Client) -> None:
    assert http.post(GENERATE_PATH, json={"token_ids": []}).status_code == 400
    bad_start = {"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 2}}
    answer = http.post(GENERATE_PATH, json=bad_start)
    assert answer.status_code == 400 and "routed_experts_prompt_start" in answer.text
    assert http.post(GENERATE_PATH, content=b"{oops").status_code == 400
    assert engine.requests[-1].body is None


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("no_choices", "expected exactly one choice"),
        ("empty_token_ids", "completion token ids are missing or empty"),
        ("no_logprobs", "the engine returned no sampled-token logprobs"),
        ("short_logprobs", "completion tokens but"),
    ],
)
def test_faults_the_wire_rejects(
    engine: ScriptedEngine, http: httpx.Client, fault: str, message: str
) -> None:
    engine.fail_next(fault)
    with pytest.raises(EngineError, match=message):
        WIRE.parse(generate(http, [1, 2, 3]).json())
    assert WIRE.parse(generate(http, [1, 2, 3]).json()).completion_ids  # only the next call


def test_expert_faults_break_rank_and_coverage(engine: ScriptedEngine, http: httpx.Client) -> None:
    engine.fail_next("experts_rank")
    engine.fail_next("experts_coverage")
    rank = WIRE.parse(generate(http, [1, 2, 3]).json())
    assert rank.routed_experts.ndim == 2
    coverage = WIRE.parse(generate(http, [1, 2, 3]).json())
    total = 3 + len(coverage.completion_ids)
    assert coverage.routed_experts.shape[0] == total - 3


def test_http_and_body_faults(engine: ScriptedEngine, http: httpx.Client) -> None:
    engine.fail_next("http_500")
    engine.fail_next("http_400")
    engine.fail_next("not_json")
    assert generate(http, [1]).status_code == 500
    assert generate(http, [1]).status_code == 400
    not_json = generate(http, [1])
    assert not_json.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        not_json.json()


def test_close_fault_drops_the_connection(engine: ScriptedEngine, http: httpx.Client) -> None:
    engine.fail_next("close")
    with pytest.raises(httpx.RemoteProtocolError):
        generate(http, [1])
    assert generate(http, [1]).status_code == 200


def test_fault_on_every_call_until_cleared(engine: ScriptedEngine, http: httpx.Client) -> None:
    engine.fail_next("http_500", times=None)
    assert [generate(http, [1]).status_code for _ in range(3)] == [500, 500, 500]
    engine.clear_faults()
    assert generate(http, [1]).status_code == 200
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        engine.fail_next("nope")
    assert "hang" in FAULTS


def test_hang_answers_after_release(engine: ScriptedEngine, http: httpx.Client) -> None:
    engine.fail_next("hang")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate, http, [1, 2])
        engine.wait_for_requests(1)
        assert not pending.done()
        engine.release()
        assert pending.result(timeout=5).status_code == 200


def test_hang_is_closed_by_stop(qwen3_tokenizer) -> None:
    engine = ScriptedEngine(qwen3_tokenizer)
    url = engine.start()
    engine.fail_next("hang")
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=url, timeout=5) as http:
        pending = pool.submit(generate, http, [1, 2])
        engine.wait_for_requests(1)
        engine.stop()
        with pytest.raises(httpx.TransportError):
            pending.result(timeout=5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/models", timeout=2)


def test_hang_times_out_a_client(engine: ScriptedEngine) -> None:
    engine.fail_next("hang")
    with httpx.Client(base_url=engine.url, timeout=0.2) as http, pytest.raises(httpx.ReadTimeout):
        generate(http, [1])

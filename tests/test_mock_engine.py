"""Tests of the scripted vLLM engine over a real socket, read back through the engine wire."""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
from server_fixtures import wait_for

from skycap.mock.engine import FAULTS, Reply, ScriptedEngine
from skycap.mock.engine_http import GENERATE_PATH
from skycap.mock.engine_wire import scripted_experts, scripted_logprob
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
        model="scripted-policy",
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
        out = WIRE.parse(generate(http, [7, 8, 9], top_k=20).json())
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


def handler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "process_request_thread" in t.name]


def test_a_client_resetting_its_connection_prints_no_traceback(
    engine: ScriptedEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pooled client closing with RST is a normal end; the demo's stderr stays clean."""
    host, port = engine.url.removeprefix("http://").rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: engine\r\n\r\n")
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    wait_for(lambda: not handler_threads(), what="the handler thread to end")
    assert "Traceback" not in capsys.readouterr().err


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


# -- validating like vLLM 0.33 -------------------------------------------------------------


def post(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post(GENERATE_PATH, json={"token_ids": [1, 2], "sampling_params": {}, **body})


def test_an_unknown_model_is_404_and_no_model_is_the_served_one(
    engine: ScriptedEngine, http: httpx.Client
) -> None:
    refused = post(http, model="gpt-4o")
    assert refused.status_code == 404
    assert refused.json()["error"]["message"] == (
        "The model `gpt-4o` does not exist. Valid aliases: scripted-policy."
    )
    assert post(http).status_code == 200 and post(http, model="scripted-policy").is_success


@pytest.mark.parametrize(
    ("salt", "ok"), [("a" * 128, True), ("a" * 129, False), ("", False), ("x/y", False), (5, False)]
)
def test_cache_salt_follows_vllm_033(
    engine: ScriptedEngine, http: httpx.Client, salt: Any, ok: bool
) -> None:
    answer = post(http, cache_salt=salt)
    assert answer.is_success is ok
    if not ok:
        assert "cache_salt" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5."),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2."),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3."),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0."),
        ({"min_tokens": 20}, "min_tokens must be less than or equal to max_tokens=16, got 20."),
        ({"stop": ["END"]}, "stop strings are not supported on a --tokens-only server"),
    ],
)
def test_sampling_values_vllm_refuses_are_400(
    engine: ScriptedEngine, http: httpx.Client, params: dict[str, Any], message: str
) -> None:
    answer = post(http, sampling_params=params)
    assert answer.status_code == 400 and message in answer.json()["error"]["message"]


def test_mask_servers_need_temperature_and_top_k(qwen3_tokenizer) -> None:
    with (
        ScriptedEngine(qwen3_tokenizer, sampling_mask=True) as engine,
        httpx.Client(base_url=engine.url) as http,
    ):
        no_k = post(http, sampling_params={"temperature": 1.0})
        greedy = post(http, sampling_params={"temperature": 0, "top_k": 5})
        ok = post(http, sampling_params={"top_k": 5})
    assert no_k.status_code == 400 and "requires top_k > 0" in no_k.text
    assert greedy.status_code == 400 and "requires temperature > 0" in greedy.text
    assert ok.json()["choices"][0]["sampling_mask"] is not None
    with pytest.raises(ValueError, match="0.26 has no sampling masks"):
        ScriptedEngine(qwen3_tokenizer, sampling_mask=True, version="0.26")


def test_a_server_without_scale_out_answers_403(qwen3_tokenizer) -> None:
    with (
        ScriptedEngine(qwen3_tokenizer, scale_out=False) as engine,
        httpx.Client(base_url=engine.url) as http,
    ):
        answer = post(http)
    assert answer.status_code == 403 and "--enable-scale-out" in answer.text


def test_several_served_names_are_listed_in_order(qwen3_tokenizer) -> None:
    with (
        ScriptedEngine(qwen3_tokenizer, model=["a", "b"]) as engine,
        httpx.Client(base_url=engine.url) as http,
    ):
        listed = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["a", "b"]
        assert post(http, model="b").is_success


# -- reply shapes of both versions ---------------------------------------------------------


@pytest.mark.parametrize("version", ["0.33", "0.26"])
def test_each_version_answers_its_own_logprob_shape(qwen3_tokenizer, version: str) -> None:
    with (
        ScriptedEngine(qwen3_tokenizer, version=version) as engine,
        httpx.Client(base_url=engine.url) as http,
    ):
        engine.queue("Hi.")
        body = post(http).json()
    (entry, *_) = body["choices"][0]["logprobs"]["content"]
    if version == "0.33":
        assert set(entry) == {"token_id", "logprob", "rank", "top_logprobs"}
        assert "sampling_mask" in body["choices"][0]
    else:
        assert entry["token"].startswith("token_id:") and "token_id" not in entry
        assert "sampling_mask" not in body["choices"][0]
    out = WIRE.parse(body)
    assert out.completion_ids == encode(qwen3_tokenizer, "Hi.") + [IM_END]


def test_int32_experts_sentinels_and_finish_reasons(qwen3_tokenizer) -> None:
    with (
        ScriptedEngine(qwen3_tokenizer, experts_dtype="int32") as engine,
        httpx.Client(base_url=engine.url) as http,
    ):
        engine.fail_next("missing_logprobs")
        engine.queue(Reply("Same same same", "repetition"), Reply("Cut", "abort"))
        body = post(http).json()
        aborted = post(http).json()
    raw = base64.b64decode(body["choices"][0]["routed_experts"])
    assert np.load(io.BytesIO(raw)).dtype == np.int32
    assert body["choices"][0]["logprobs"]["content"][0]["logprob"] == -9999.0
    assert body["choices"][0]["finish_reason"] == "repetition"
    out = WIRE.parse(body)
    assert out.routed_experts.dtype == np.uint16 and np.isnan(out.logprobs[0])
    assert out.finish_reason == "stop" and out.engine_finish_reason == "repetition"
    assert out.completion_ids == encode(qwen3_tokenizer, "Same same same")  # no stop token
    assert aborted["choices"][0]["finish_reason"] == "abort"
    with pytest.raises(EngineError, match="'abort'"):
        WIRE.parse(aborted)

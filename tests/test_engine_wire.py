"""Tests of the engine wire: sampling merge, the generate request body and the reply checks."""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any

import numpy as np
import pytest

from skycap.arrays import pack
from skycap.dialects.chat import recorded_sampling
from skycap.tokens.engine import EngineError, EngineOutput, VLLMEngine, merge_sampling

STOPS = [151645, 151643]


def npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return base64.b64encode(buffer.getvalue()).decode()


def reply(**choice: Any) -> dict[str, Any]:
    base = {
        "index": 0,
        "token_ids": [5, 6, 7],
        "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.5} for t in (5, 6, 7)]},
        "finish_reason": "stop",
    }
    base.update(choice)
    return {"request_id": "r", "usage": {}, "choices": [base]}


# -- sampling merge (http.md §3.2) ---------------------------------------------------------


def test_merge_follows_the_spec_example() -> None:
    merged = merge_sampling(
        {"temperature": 0.7, "max_tokens": 50},
        {"top_k": 20},
        room=10000 - 800,
        stop_token_ids=STOPS,
    )
    assert merged == {"temperature": 0.7, "max_tokens": 50, "top_k": 20, "stop_token_ids": STOPS}


def test_max_completion_tokens_folds_per_side_and_overrides_win() -> None:
    caller = {"max_tokens": 10, "max_completion_tokens": 20}
    assert merge_sampling(caller, {}, room=None, stop_token_ids=[])["max_tokens"] == 20
    merged = merge_sampling(
        {"max_completion_tokens": 20}, {"max_tokens": 5}, room=None, stop_token_ids=[]
    )
    assert merged == {"max_tokens": 5, "stop_token_ids": []}


def test_room_clamps_or_sets_max_tokens() -> None:
    assert merge_sampling({"max_tokens": 50}, {}, room=30, stop_token_ids=[])["max_tokens"] == 30
    assert merge_sampling({}, {}, room=30, stop_token_ids=[])["max_tokens"] == 30
    assert "max_tokens" not in merge_sampling({}, {}, room=None, stop_token_ids=[])
    with pytest.raises(ValueError, match="max_tokens must be an integer, got '50'"):
        merge_sampling({"max_tokens": "50"}, {}, room=30, stop_token_ids=[])


def test_stop_token_ids_default_only_when_absent() -> None:
    merged = merge_sampling({}, {"stop_token_ids": [1]}, room=None, stop_token_ids=STOPS)
    assert merged["stop_token_ids"] == [1]


def test_caller_sampling_keeps_listed_non_null_fields() -> None:
    """Token mode reads the caller's sampling with the text-mode recipe (http.md §3.2)."""
    body = {"temperature": 0, "top_p": None, "stop_token_ids": [1], "ignore_eos": True, "seed": 3}
    assert recorded_sampling(body) == {"temperature": 0, "seed": 3}


# -- request (docs/tokens.md "The engine: vLLM")
# ---------------------------------------------------------------


def test_request_filters_sampling_keys_and_adds_logprobs() -> None:
    sampling = {"temperature": 0.7, "top_k": 20, "custom": 1, "stop_token_ids": STOPS}
    body = VLLMEngine().request(
        prompt_ids=[1, 2, 3],
        sampling=sampling,
        model="policy",
        cache_salt="salt",
        sampling_mask=True,
        routes_from=2,
    )
    assert body == {
        "token_ids": [1, 2, 3],
        "sampling_params": {
            "temperature": 0.7,
            "top_k": 20,
            "stop_token_ids": STOPS,
            "logprobs": 0,
            "routed_experts_prompt_start": 2,
        },
        "model": "policy",
        "cache_salt": "salt",
    }
    assert sampling == {"temperature": 0.7, "top_k": 20, "custom": 1, "stop_token_ids": STOPS}


def test_request_omits_empty_optionals_and_unsupported_route_start() -> None:
    class NoRoutes(VLLMEngine):
        routes_from_supported = False

    body = NoRoutes().request(
        prompt_ids=[1, 2, 3],
        sampling={},
        model="",
        cache_salt=None,
        sampling_mask=False,
        routes_from=2,
        features={},
    )
    assert body == {"token_ids": [1, 2, 3], "sampling_params": {"logprobs": 0}}
    with_features = VLLMEngine().request(
        prompt_ids=[1],
        sampling={},
        model=None,
        cache_salt=None,
        sampling_mask=False,
        features={"mm_hashes": {}},
    )
    assert with_features["features"] == {"mm_hashes": {}}
    assert "routed_experts_prompt_start" not in with_features["sampling_params"]


def test_request_rejects_a_route_start_outside_the_prompt() -> None:
    with pytest.raises(ValueError, match=r"routes_from must be in \[0, 3\)"):
        VLLMEngine().request(
            prompt_ids=[1, 2, 3],
            sampling={},
            model=None,
            cache_salt=None,
            sampling_mask=False,
            routes_from=3,
        )


def test_engine_defaults_match_the_spec() -> None:
    engine = VLLMEngine()
    assert (engine.name, engine.generate_path, engine.release_path) == (
        "vllm",
        "/inference/v1/generate",
        None,
    )
    assert engine.routes_from_supported is True
    assert "stop_token_ids" in engine.sampling_keys and "logprobs" not in engine.sampling_keys


# -- parse (docs/tokens.md "The engine: vLLM")
# -----------------------------------------------------------------


def test_parse_reads_a_full_reply() -> None:
    experts = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    out = VLLMEngine().parse(
        reply(
            routed_experts=npy(experts),
            sampling_mask=[[5, 9], [6], [7, 1]],
            finish_reason=None,
        ),
        routes_from=4,
    )
    assert isinstance(out, EngineOutput)
    assert out.completion_ids == [5, 6, 7] and out.logprobs == [-0.5, -0.5, -0.5]
    assert out.finish_reason == "stop"
    assert out.routed_start == 4
    assert out.routed_experts is not None and np.array_equal(out.routed_experts, experts)
    assert out.sampling_mask == [[5, 9], [6], [7, 1]]


def test_parse_without_side_channels() -> None:
    out = VLLMEngine().parse(reply(finish_reason="length", routed_experts=None), routes_from=4)
    assert out.routed_experts is None and out.sampling_mask is None
    assert out.finish_reason == "length"


def test_envelope_start_overrides_and_unsupported_routes_start_at_zero() -> None:
    experts = np.ones((3, 1, 2), dtype=np.uint16)
    envelope = {**pack(experts), "start": 0}
    out = VLLMEngine().parse(reply(routed_experts=envelope), routes_from=5)
    assert out.routed_start == 0 and out.routed_experts.dtype == np.uint16

    class NoRoutes(VLLMEngine):
        routes_from_supported = False

    out = NoRoutes().parse(reply(routed_experts=npy(experts)), routes_from=5)
    assert out.routed_start == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "expected exactly one choice"),
        ({"choices": []}, "expected exactly one choice"),
        ({"choices": [{}, {}]}, "expected exactly one choice"),
        ({"choices": ["x"]}, "expected exactly one choice"),
        (reply(token_ids=[]), "completion token ids are missing or empty"),
        (reply(token_ids=None), "completion token ids are missing or empty"),
        (reply(token_ids=[1, -2, 3]), "completion token ids must be non-negative integers"),
        (
            reply(logprobs=None),
            "the engine returned no sampled-token logprobs; token capture requires them",
        ),
        (
            reply(logprobs={"content": None}),
            "the engine returned no sampled-token logprobs; token capture requires them",
        ),
        (
            reply(logprobs={"content": [{"logprob": -1.0}] * 2}),
            "3 completion tokens but 2 logprobs",
        ),
        (
            reply(logprobs={"content": [{"logprob": -1.0}, {"logprob": None}, {"logprob": -1}]}),
            "3 completion tokens but 2 logprobs",
        ),
        (reply(finish_reason=3), "finish_reason must be a string, got 3"),
        (reply(sampling_mask=[[1], [2]]), "sampling_mask has 2 rows for 3 completion tokens"),
        (reply(sampling_mask={"rows": []}), "sampling_mask must be a list of rows, got dict"),
        (reply(sampling_mask=[[1], "x", [2]]), "sampling_mask row 1 must be a list of token ids"),
        (reply(routed_experts="not base64!"), "cannot decode the base64 .npy payload"),
        (
            reply(routed_experts=base64.b64encode(b"not npy").decode()),
            "cannot decode the base64 .npy payload",
        ),
        (
            reply(routed_experts=npy(np.array([{"a": 1}], dtype=object))),
            "cannot decode the base64 .npy payload",
        ),
        (
            reply(routed_experts=npy(np.zeros((2, 1, 1), dtype=np.float32))),
            "routed_experts dtype must be uint8, uint16 or int32, got float32",
        ),
        (
            reply(routed_experts={"data": "AA==", "shape": [3], "dtype": "uint8"}),
            "invalid packed array",
        ),
        (
            reply(routed_experts={**pack(np.zeros((1, 1, 1), np.uint8)), "start": -1}),
            "invalid packed array: start must be a non-negative integer",
        ),
        (reply(routed_experts=[1, 2]), "routed_experts must be a base64 .npy string"),
    ],
)
def test_parse_rejects_bad_replies_with_the_spec_messages(body: Any, message: str) -> None:
    with pytest.raises(EngineError) as info:
        VLLMEngine().parse(body)
    assert message in str(info.value)


def test_side_channels_hook_is_overridable() -> None:
    class Custom(VLLMEngine):
        def _side_channels(self, choice: dict[str, Any], output: EngineOutput) -> None:
            output.sampling_mask = choice["my_mask"]

    out = Custom().parse(reply(my_mask=[[1], [2], [3]]))
    assert out.sampling_mask == [[1], [2], [3]]


def test_pickled_npy_is_never_loaded() -> None:
    payload = base64.b64encode(pickle.dumps([1, 2])).decode()
    with pytest.raises(EngineError, match="cannot decode"):
        VLLMEngine().parse(reply(routed_experts=payload))


# -- vLLM's real reply shapes (0.26 and 0.33) ----------------------------------------------


def test_request_never_forwards_stop_strings() -> None:
    """A --tokens-only vLLM refuses any stop string; skycap applies them itself."""
    body = VLLMEngine().request(
        prompt_ids=[1, 2],
        sampling={"stop": ["END"], "temperature": 0.5},
        model=None,
        cache_salt=None,
        sampling_mask=False,
    )
    assert body["sampling_params"] == {"temperature": 0.5, "logprobs": 0}


def test_both_logprob_entry_shapes_are_read_and_checked_per_token() -> None:
    v26 = [{"token": f"token_id:{t}", "logprob": -0.5, "bytes": None} for t in (5, 6, 7)]
    v33 = [{"token_id": t, "logprob": -0.25, "rank": 1, "top_logprobs": []} for t in (5, 6, 7)]
    assert VLLMEngine().parse(reply(logprobs={"content": v26})).logprobs == [-0.5] * 3
    assert VLLMEngine().parse(reply(logprobs={"content": v33})).logprobs == [-0.25] * 3
    for shifted in (
        [{**v26[0], "token": "token_id:6"}, *v26[1:]],
        [v33[0], {**v33[1], "token_id": 9}, v33[2]],
    ):
        with pytest.raises(EngineError, match="logprob entry .* is for token .* but completion"):
            VLLMEngine().parse(reply(logprobs={"content": shifted}))


def test_the_no_logprob_sentinel_is_nan_and_counted() -> None:
    entries = [
        {"token_id": 5, "logprob": -9999.0},
        {"token_id": 6, "logprob": -0.5},
        {"token": "token_id:7", "logprob": -9999.0},
    ]
    out = VLLMEngine().parse(reply(logprobs={"content": entries}))
    assert np.isnan(out.logprobs[0]) and out.logprobs[1] == -0.5 and np.isnan(out.logprobs[2])
    assert out.missing_logprobs == 2


def test_int32_experts_are_narrowed_losslessly_or_refused() -> None:
    experts = np.array([[[0, 300]], [[65535, 7]]], dtype=np.int32)
    out = VLLMEngine().parse(reply(token_ids=[5, 6, 7], routed_experts=npy(experts)))
    assert out.routed_experts.dtype == np.uint16
    assert np.array_equal(out.routed_experts, experts)
    with pytest.raises(EngineError, match=r"int32 ids must be in \[0, 65535\], got \[-1, 7\]"):
        VLLMEngine().parse(reply(routed_experts=npy(np.array([[[-1, 7]]], dtype=np.int32))))


@pytest.mark.parametrize(("engine", "ours"), [("repetition", "stop"), ("length", "length")])
def test_repetition_is_a_normal_stop(engine: str, ours: str) -> None:
    out = VLLMEngine().parse(reply(finish_reason=engine))
    assert out.finish_reason == ours
    assert out.engine_finish_reason == (engine if engine != ours else None)


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_abort_and_error_are_engine_failures(reason: str) -> None:
    with pytest.raises(EngineError, match=f"finish_reason '{reason}'"):
        VLLMEngine().parse(reply(finish_reason=reason))

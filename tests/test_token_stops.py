"""Tests of skycap's stop strings (skycap.tokens.stops) with the real Qwen3 renderer, against
the rules of vLLM's detokenizer (v1/engine/detokenizer.py `check_stop_strings`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from skycap.tokens.engine import EngineOutput
from skycap.tokens.stops import apply_stop, find_stop, strip_stop

IM_END = 151645


@pytest.fixture(scope="module")
def encode(qwen3_tokenizer: Any):
    def run(text: str) -> list[int]:
        return qwen3_tokenizer.encode(text, add_special_tokens=False)

    return run


def test_the_stop_completing_first_wins_and_ties_go_by_list_order(
    qwen3_renderer: Any, encode: Any
) -> None:
    ids = encode("alpha beta gamma") + [IM_END]
    first = find_stop(qwen3_renderer, ids, ["gamma", "beta"])
    assert first is not None and first.stop == "beta" and first.text == "alpha "
    # "ta" and "beta" both complete at the same character: list order decides.
    tie = find_stop(qwen3_renderer, ids, ["ta", "beta"])
    assert tie is not None and tie.stop == "ta"
    assert find_stop(qwen3_renderer, ids, ["delta"]) is None
    assert find_stop(qwen3_renderer, ids, []) is None


def test_tokens_are_kept_through_the_one_completing_the_stop(
    qwen3_renderer: Any, qwen3_tokenizer: Any, encode: Any
) -> None:
    ids = encode("one two three four") + [IM_END]
    match = find_stop(qwen3_renderer, ids, ["o th"])  # spans the tokens " two" and " three"
    assert match is not None
    kept = qwen3_tokenizer.decode(ids[: match.keep])
    assert kept == "one two three" and match.text == "one tw"
    assert match.tail == "o three"


def test_the_final_stop_token_is_not_text_and_min_tokens_delays_the_check(
    qwen3_renderer: Any, encode: Any
) -> None:
    ids = encode("x y x y") + [IM_END]
    assert find_stop(qwen3_renderer, ids, ["<|im_end|>"]) is None
    assert find_stop(qwen3_renderer, ids, ["<|im_end|>"], skip_special_tokens=False) is None
    early = find_stop(qwen3_renderer, ids, ["x"])
    late = find_stop(qwen3_renderer, ids, ["x"], min_tokens=1)
    assert early is not None and early.keep == 1
    assert late is not None and late.keep == 3 and late.text == "x y "
    # A stop that begins inside the first min_tokens tokens but ends after them counts.
    spanning = find_stop(qwen3_renderer, ids, ["x y"], min_tokens=1)
    assert spanning is not None and spanning.keep == 2 and spanning.text == ""


def test_apply_stop_cuts_logprobs_masks_and_experts(qwen3_renderer: Any, encode: Any) -> None:
    ids = encode("a b c d") + [IM_END]
    prompt = [1, 2, 3]
    total = len(prompt) + len(ids)
    output = EngineOutput(
        completion_ids=list(ids),
        logprobs=[-0.1 * (i + 1) for i in range(len(ids))],
        finish_reason="length",
        routed_experts=np.zeros((total - 1, 2, 2), dtype=np.uint8),
        sampling_mask=[[t] for t in ids],
    )
    match = apply_stop(qwen3_renderer, output, [" c"], prompt)
    assert match is not None and match.keep == 3
    assert output.completion_ids == ids[:3] and len(output.logprobs) == 3
    assert output.sampling_mask == [[t] for t in ids[:3]]
    assert output.routed_experts.shape[0] == len(prompt) + 3 - 1
    assert output.finish_reason == "stop"


def test_strip_stop_cuts_content_or_reasoning(qwen3_renderer: Any, encode: Any) -> None:
    ids = encode("<think>\nwait STOP here\n</think>\n\nanswer")
    match = find_stop(qwen3_renderer, ids, ["STOP"])
    assert match is not None
    parsed = qwen3_renderer.parse(ids[: match.keep], None)
    stripped = strip_stop(parsed, match)
    assert stripped["reasoning_content"].strip() == "wait" and "STOP" not in str(stripped)
    message = {"role": "assistant", "content": "The end. STOP"}
    tail_match = find_stop(qwen3_renderer, encode("The end. STOP!"), ["STOP"])
    assert strip_stop(message, tail_match)["content"] == "The end. "

"""The streamed-reply pieces on their own: the delta splitter and the engine stream reader."""

from __future__ import annotations

import numpy as np
import pytest

from skycap.mock.engine_wire import npy_base64
from skycap.tokens.deltas import CONTENT, REASONING, DeltaSplitter, Markup
from skycap.tokens.engine import EngineError, EngineStream, VLLMEngine


def feed_all(splitter: DeltaSplitter, pieces: list[str]) -> dict[str, str]:
    out = {REASONING: "", CONTENT: ""}
    for piece in pieces:
        for part, text in splitter.feed(piece):
            out[part] += text
    return out


def test_thinking_and_content_are_split_without_their_edge_whitespace() -> None:
    splitter = DeltaSplitter(Markup(), raw=False, thinking=False, hold=0)
    pieces = ["<", "think>", "\n", "Step", " 1.", "\n", "</think>"]
    sent = feed_all(splitter, pieces)
    assert sent == {REASONING: "Step 1.", CONTENT: ""}
    splitter.close_reasoning()
    sent = feed_all(splitter, ["\n\n", "Hello", " ", "there", "."])
    assert sent[CONTENT] == "Hello there."
    assert splitter.remainder(CONTENT, "Hello there.") == ""


def test_a_tool_call_block_and_a_partial_tag_are_held_back() -> None:
    splitter = DeltaSplitter(Markup(), raw=False, thinking=False, hold=0)
    sent = feed_all(splitter, ["Let", " me", " look", " <tool", "_call>", '\n{"name"'])
    assert sent[CONTENT] == "Let me look"  # nothing from the block, nor the partial tag
    assert feed_all(splitter, ["}\n</tool_call>"])[CONTENT] == ""
    assert splitter.remainder(CONTENT, "Let me look") == ""


def test_a_stop_string_being_matched_is_held_back() -> None:
    splitter = DeltaSplitter(Markup(), raw=False, thinking=False, hold=len("STOP") - 1)
    sent = feed_all(splitter, ["alpha", " beta", " ST"])
    assert sent[CONTENT] == "alpha beta"  # " ST" may begin the stop string
    splitter.add("OP")  # the caller cuts here: nothing of it is sent
    assert splitter.remainder(CONTENT, "alpha beta ") == " "


def test_raw_content_streams_everything_and_unknown_markup_holds_everything() -> None:
    raw = DeltaSplitter(Markup(), raw=True, thinking=False, hold=0)
    assert feed_all(raw, ["<think>", "x</think>", " y "])[CONTENT] == "<think>x</think> y "
    unknown = DeltaSplitter(None, raw=False, thinking=False, hold=0)
    assert feed_all(unknown, ["Hello", " world"]) == {REASONING: "", CONTENT: ""}
    assert unknown.remainder(CONTENT, "Hello world") == "Hello world"


def test_a_parse_the_splitter_did_not_foresee_is_reported() -> None:
    splitter = DeltaSplitter(Markup(), raw=False, thinking=True, hold=0)
    feed_all(splitter, ["\n", "abc", " def"])
    assert splitter.remainder(REASONING, "\nabc def") is None  # an unclosed block keeps "\n"


def _chunk(ids: list[int], finish: str | None = None, **extra: object) -> dict[str, object]:
    entries = [{"token_id": t, "logprob": -0.5, "rank": 1} for t in ids]
    choice = {"index": 0, "token_ids": ids, "logprobs": {"content": entries}}
    return {
        "request_id": "generate-tokens-r1",
        "choices": [{**choice, "finish_reason": finish, **extra}],
    }


def test_engine_stream_keeps_engine_order_and_reads_like_a_whole_reply() -> None:
    stream = EngineStream(VLLMEngine(), routes_from=0)
    experts = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    assert stream.feed(_chunk([5, 6], sampling_mask=[[5], [6, 7]])) == [5, 6]
    stream.feed(_chunk([7], "stop", sampling_mask=[[7]], routed_experts=npy_base64(experts)))
    stream.feed({"request_id": "generate-tokens-r1", "choices": [], "usage": {}})
    output = stream.finish()
    assert output.completion_ids == [5, 6, 7] and output.logprobs == [-0.5] * 3
    assert output.sampling_mask == [[5], [6, 7], [7]] and stream.request_id == "generate-tokens-r1"
    assert output.routed_experts is not None and output.routed_experts.tolist() == experts.tolist()


def test_engine_stream_failures_are_engine_errors() -> None:
    broken = EngineStream(VLLMEngine(), routes_from=0)
    broken.feed(_chunk([5, 6]))
    with pytest.raises(EngineError, match="without a finish reason after 2 tokens"):
        broken.finish()
    with pytest.raises(EngineError, match="reported an error"):
        EngineStream(VLLMEngine(), 0).feed({"error": {"message": "boom"}})
    aborted = EngineStream(VLLMEngine(), routes_from=0)
    aborted.feed(_chunk([5], "abort"))
    with pytest.raises(EngineError, match="abort"):
        aborted.finish()
    cut = EngineStream(VLLMEngine(), routes_from=0)
    cut.feed(_chunk([5, 6]))
    assert cut.finish(stopped=True).finish_reason == "stop"  # skycap aborted it at a stop

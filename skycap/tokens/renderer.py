"""Token-mode renderers: the protocol token mode needs, and the helpers every renderer shares.

A renderer turns chat messages into the exact prompt token ids (with one message index per
token so the graph can attribute them), extends a previous prompt + completion without
re-tokenising sampled tokens (the bridge), parses a completion into a reply message, and
decodes tokens to text with per-token byte offsets (docs/tokens.md "Engines and renderers",
format.md §6.1).
The default one is skycap.tokens.library_renderer's; skycap.tokens.renderer_pool runs them.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from skycap.hashing import canonical_json

__all__ = [
    "RAW_CONTENT_CONTEXT",
    "RenderError",
    "Rendered",
    "Renderer",
    "decode_spans_as",
    "parse_reply",
    "raw_content",
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
    """

    token_ids: list[int]
    message_indices: list[int]
    reused: int = 0
    media: list[Any] = field(default_factory=list)


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

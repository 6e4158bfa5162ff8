"""The render cache a server's trajectories share: a prompt rendered once is not rendered again.

A GRPO group sends the same system prompt and task once per repetition, each the first call
of a new trajectory, which cannot bridge from anything; without the cache each one costs a
full render (about 1.6 ms per 1k tokens with Qwen3). Entries are keyed by what a render is a
function of: the renderer's digest (tokenizer, template, renderer and its settings), the
tools and each message, as the values the renderer is handed
(docs/tokens.md "The render cache").
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from skycap.tokens.renderer import Rendered, Renderer, shared_ids

#: Bytes an entry costs besides its token ids and indices (key, array headers, LRU links).
ENTRY_OVERHEAD = 256


class Uncacheable(Exception):
    """A value the key cannot name exactly (a type outside JSON's, such as a tuple)."""


def _feed(digest: Any, value: Any) -> None:
    """Feed `value` to `digest` as an unambiguous encoding of its JSON type, order and content.

    Dict order is kept, not sorted: a template writes a tool's JSON schema in the order it is
    given, so two orders can render differently. Types are exact (`1`, `1.0` and `True`
    differ; a tuple or a str subclass is refused), so equal keys mean equal render inputs.
    """
    kind = type(value)
    if kind is str:
        data = value.encode("utf-8", "surrogatepass")
        digest.update(b"s%d:" % len(data))
        digest.update(data)
    elif kind is dict:
        digest.update(b"d%d:" % len(value))
        for key, item in value.items():
            if type(key) is not str:
                raise Uncacheable(f"a {type(key).__name__} key")
            _feed(digest, key)
            _feed(digest, item)
    elif kind is list:
        digest.update(b"l%d:" % len(value))
        for item in value:
            _feed(digest, item)
    elif value is None or kind is bool or kind is int or kind is float:
        digest.update(b"v" + repr(value).encode() + b";")
    else:
        raise Uncacheable(f"a {kind.__name__} value")


def prefix_keys(
    scope: bytes, messages: Sequence[Any], tools: Sequence[Any] | None
) -> list[bytes] | None:
    """The key of each prefix of `messages` (one to all of them), or None when uncacheable.

    Each key chains the previous one with the next message, so a longer conversation's
    keys start with a shorter one's and a cached prefix is found by its key alone.
    """
    head = hashlib.blake2b(scope, digest_size=20)
    try:
        _feed(head, list(tools) if tools else None)
        chained = head.digest()
        keys = []
        for message in messages:
            step = hashlib.blake2b(chained, digest_size=20)
            _feed(step, message)
            chained = step.digest()
            keys.append(chained)
    except Uncacheable:
        return None
    return keys


class _Entry:
    __slots__ = ("ids", "indices", "size")

    def __init__(self, rendered: Rendered) -> None:
        self.ids = _frozen(rendered.token_ids)
        self.indices = _frozen(rendered.message_indices)
        self.size = (len(self.ids) + len(self.indices)) * 4 + ENTRY_OVERHEAD

    def rendered(self) -> Rendered:
        """Fresh lists each time, so a caller changing them cannot change a later hit, the ids
        as shared ints (quicker to make than new ones, and what a trajectory keeps); with the
        entry's own arrays, read-only, so the plan need not convert the lists back."""
        return Rendered(
            shared_ids(self.ids),
            self.indices.tolist(),
            arrays=(self.ids, self.indices),
            shared=True,
        )


def _frozen(values: list[int]) -> np.ndarray:
    """`values` as a read-only int32 array (token ids and message indices both fit)."""
    out = np.array(values, dtype=np.int32)
    out.flags.writeable = False
    return out


class RenderCache:
    """Full renders by prefix key, least recently used evicted first, at most `max_bytes`.

    Thread-safe: every renderer slot of the pool reads and fills it. An entry costs 8 bytes
    a token (ids and message indices as 32-bit arrays).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.bytes = 0

    def lookup(
        self, key: bytes, *, count_hit: bool = True, count_miss: bool = True
    ) -> Rendered | None:
        """The render cached under `key`, counted as a hit or a miss unless told not to."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                if count_hit:
                    self.hits += 1
            elif count_miss:
                self.misses += 1
        return None if entry is None else entry.rendered()

    def store(self, key: bytes, rendered: Rendered) -> None:
        """Keep `rendered` under `key`, evicting the least recently used to stay in bounds."""
        if rendered.media or rendered.reused:
            return
        entry = _Entry(rendered)
        if entry.size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.size
            self._entries[key] = entry
            self.bytes += entry.size
            while self.bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= evicted.size

    def counters(self) -> dict[str, int]:
        """The `/healthz` counters (docs/tokens.md "The render cache")."""
        with self._lock:
            return {
                "render_cache_hits": self.hits,
                "render_cache_misses": self.misses,
                "render_cache_bytes": self.bytes,
            }


class CachedRenderer:
    """A renderer slot whose `render` goes through the server's render cache.

    Everything else is the slot's own. A miss whose messages extend a cached prompt asks the
    slot to render only the new messages after it (`extend_render`, where the renderer
    offers one; it declines where that would not be exactly a fresh render); else the slot
    renders in full. Either result is cached.
    """

    def __init__(self, inner: Renderer, cache: RenderCache, scope: bytes) -> None:
        self._inner = inner
        self._cache = cache
        self._scope = scope

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> Rendered:
        keys = prefix_keys(self._scope, messages, tools)
        if keys is None:
            return self._inner.render(messages, tools)
        cache = self._cache
        hit = cache.lookup(keys[-1])
        if hit is not None:
            return hit
        rendered = self._extended(keys, messages, tools) or self._inner.render(messages, tools)
        cache.store(keys[-1], rendered)
        return rendered

    def _extended(
        self, keys: list[bytes], messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> Rendered | None:
        """The render of `messages` from the longest cached prefix of them, or None."""
        extend = getattr(self._inner, "extend_render", None)
        if extend is None:
            return None
        for length in range(len(keys) - 1, 0, -1):
            prefix = self._cache.lookup(keys[length - 1], count_hit=False, count_miss=False)
            if prefix is not None:
                return extend(prefix, messages[:length], messages[length:], tools)
        return None


class NotCached(Exception):
    """What a CacheOnly renderer raises for anything but a render the cache holds."""


class CacheOnly:
    """The render cache as a renderer that renders nothing, safe to use on the event loop.

    `render` answers a prompt the cache holds, counted as a hit; anything else, and every
    bridge, raises NotCached, and the caller then does the work on a renderer thread (which
    counts the miss). A cached prompt needs no tokenizer, so a call planned from it is
    spared the hop to a renderer thread and back, a large share of what a hit costs.
    """

    def __init__(self, cache: RenderCache, scope: bytes) -> None:
        self._cache = cache
        self._scope = scope

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> Rendered:
        keys = prefix_keys(self._scope, messages, tools)
        hit = None if keys is None else self._cache.lookup(keys[-1], count_miss=False)
        if hit is None:
            raise NotCached
        return hit

    def bridge(self, *args: Any, **kwargs: Any) -> Rendered | None:
        raise NotCached

"""The renderer pool: renderer slots on worker threads, so renderer work never runs on the
event loop, all built when the server starts, seen through the server's render cache; and
the pool token mode builds from its options (the library's or a ready one)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from skycap.tokens.library_renderer import LibraryRenderer
from skycap.tokens.render_cache import CachedRenderer, CacheOnly, NotCached, RenderCache
from skycap.tokens.renderer import Renderer

T = TypeVar("T")


class RendererPool:
    """`size` renderer slots used from worker threads, never on the event loop.

    Each slot owns its renderer (tokenizers are not safe to share across threads for every
    operation). The first slot is built on the calling thread, so a download or a bad
    tokenizer name fails there; `fill` builds the others when the server starts (loading a
    tokenizer takes seconds of CPU, which a burst of new trajectories must not pay), and a
    pool used before that builds them as threads first need them. With `cache`, every
    slot's `render` goes through it, scoped by the primary's `render_digest`; a renderer
    without one (a custom `renderer=` object may keep state) is never cached. A custom
    renderer goes in as `RendererPool(lambda: renderer, 1)`.
    """

    def __init__(
        self, factory: Callable[[], Renderer], size: int, cache: RenderCache | None = None
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"renderer_pool_size must be an integer >= 1, got {size!r}")
        self._factory = factory
        self._size = size
        self.primary: Renderer = factory()
        self._free: list[Renderer] = [self.primary]
        self._built = 1
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(size)
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="skycap-render")
        scope = getattr(self.primary, "render_digest", None)
        self.cache = cache if isinstance(scope, bytes) else None
        self._scope = scope if isinstance(scope, bytes) else b""

    @property
    def size(self) -> int:
        return self._size

    def fill(self) -> float:
        """Build every slot not built yet, on the worker threads at once; the seconds taken.

        Blocking: the server calls it off the event loop when it starts.
        """
        started = time.perf_counter()
        with self._lock:
            missing = self._size - self._built
            self._built = self._size
        futures = [self._executor.submit(self._factory) for _ in range(missing)]
        built = [future.result() for future in futures]
        with self._lock:
            self._free.extend(built)
        return time.perf_counter() - started

    def call(self, fn: Callable[[Renderer], T]) -> T:
        """Run `fn(renderer)` on the calling (non-loop) thread with a slot held."""
        with self._slots:
            renderer = self._acquire()
            try:
                if self.cache is None:
                    return fn(renderer)
                return fn(CachedRenderer(renderer, self.cache, self._scope))  # type: ignore[arg-type]
            finally:
                with self._lock:
                    self._free.append(renderer)

    def from_cache(self, fn: Callable[[Renderer], T]) -> T | None:
        """`fn(renderer)` on the calling thread, the event loop included, with a renderer that
        only answers renders the cache holds; None without a cache or when `fn` needed more.

        Looking up costs hashing the messages and copying the cached ids, which the caller
        bounds; nothing here touches a tokenizer.
        """
        if self.cache is None:
            return None
        try:
            return fn(CacheOnly(self.cache, self._scope))  # type: ignore[arg-type]
        except NotCached:
            return None

    async def run(self, fn: Callable[[Renderer], T]) -> T:
        """Run `fn(renderer)` on a pool thread and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.call, fn)

    def _acquire(self) -> Renderer:
        """A free renderer, or a new one: the semaphore caps how many exist at `size`."""
        with self._lock:
            if self._free:
                return self._free.pop()
            self._built += 1
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
    cache: RenderCache | None = None,
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
        return RendererPool(lambda: renderer, 1, cache)
    return RendererPool(
        lambda: LibraryRenderer(
            tokenizer, renderer_name=renderer_name, chat_template_kwargs=chat_template_kwargs
        ),
        size,
        cache,
    )

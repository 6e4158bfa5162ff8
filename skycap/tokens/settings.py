"""A token-mode server's settings, checked once when the backend is built: what every turn
reads (the options, the engine wire and its client, the renderer pool, the sampling)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from skycap.dialects.chat import REASONING_FIELDS
from skycap.tokens.client import EngineClient
from skycap.tokens.engine import EngineWire, VLLMEngine
from skycap.tokens.models import ServedModel
from skycap.tokens.options import TokenOptions
from skycap.tokens.render_cache import RenderCache
from skycap.tokens.renderer_pool import RendererPool, renderer_pool
from skycap.tokens.sampling import check_overrides, generation_folders, load_generation_config


@dataclass(frozen=True, slots=True)
class TokenSettings:
    """The options of a token-mode server and what is built from them, as the turn uses them.

    `sampling_overrides` are the options' own, checked; `generation_defaults` are the
    model's own sampling defaults for what a request omits; `stop_token_ids` and
    `think_end` come from the primary renderer.
    """

    options: TokenOptions
    upstream_url: str
    engine: EngineWire
    client: EngineClient
    served: ServedModel
    pool: RendererPool
    sampling_overrides: dict[str, Any]
    generation_defaults: dict[str, Any]
    stop_token_ids: list[int]
    think_end: int | None

    @classmethod
    def build(cls, options: TokenOptions) -> TokenSettings:
        """Check the options and build the pool and the engine client; ValueError names
        the option at fault."""
        if not options.upstream_url:
            raise ValueError(
                "token mode needs upstream_url: the engine root, e.g. http://engine:8000"
            )
        overrides = options.sampling_overrides
        if overrides is not None and not isinstance(overrides, Mapping):
            raise ValueError(
                f"sampling_overrides must be a mapping, got {type(overrides).__name__}"
            )
        if options.reasoning_field not in REASONING_FIELDS:
            raise ValueError(
                f"reasoning_field must be one of {', '.join(REASONING_FIELDS)}, "
                f"got {options.reasoning_field!r}"
            )
        overrides = dict(overrides or {})
        check_overrides(overrides, options.sampling_mask)
        defaults, _ = load_generation_config(
            options.generation_config, generation_folders(options.tokenizer)
        )
        upstream_url = options.upstream_url.rstrip("/")
        engine = options.engine or VLLMEngine()
        pool = renderer_pool(
            options.tokenizer,
            options.renderer,
            options.renderer_name,
            options.chat_template_kwargs,
            options.renderer_pool_size,
            _render_cache(options.render_cache_mib),
        )
        return cls(
            options=options,
            upstream_url=upstream_url,
            engine=engine,
            client=EngineClient(upstream_url, options.api_key, engine, options.upstream_timeout),
            served=ServedModel(options.model or None, engine.served_names, engine.models_path),
            pool=pool,
            sampling_overrides=overrides,
            generation_defaults=defaults,
            stop_token_ids=list(pool.primary.stop_token_ids),
            think_end=getattr(pool.primary, "think_end_id", None),
        )

    def cache_counters(self) -> dict[str, int]:
        """The render cache's `/healthz` counters (zeros with the cache off)."""
        cache = self.pool.cache
        if cache is None:
            return {"render_cache_hits": 0, "render_cache_misses": 0, "render_cache_bytes": 0}
        return cache.counters()

    @property
    def skip_special_tokens(self) -> bool:
        return not self.options.keep_special_tokens

    def reasoning_keys(self) -> tuple[str, ...]:
        """The reasoning keys a Chat Completions reply answers (`--reasoning-field`)."""
        if self.options.use_raw_content:
            return ()
        if self.options.reasoning_field == "both":
            return ("reasoning_content", "reasoning")
        return (self.options.reasoning_field,)


def _render_cache(mib: int) -> RenderCache | None:
    """The server's render cache of `mib` MiB (`--render-cache-mib`), or None for 0 (off)."""
    if isinstance(mib, bool) or not isinstance(mib, int) or mib < 0:
        raise ValueError(f"render_cache_mib must be an integer >= 0, got {mib!r}")
    return RenderCache(mib << 20) if mib else None

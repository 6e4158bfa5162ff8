"""A token-mode server's settings, checked once by the backend: what every turn reads (the
engine wire and its client, the renderer pool, the sampling and the reply options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skycap.tokens.client import EngineClient
from skycap.tokens.engine import VLLMEngine
from skycap.tokens.models import ServedModel
from skycap.tokens.renderer_pool import RendererPool


@dataclass(frozen=True, slots=True)
class TokenSettings:
    """The options of skycap.tokens.backend.TokenBackend, as the turn uses them.

    `generation_defaults` are the model's own sampling defaults; `stop_token_ids`
    and `think_end` come from the primary renderer.
    """

    engine: VLLMEngine
    client: EngineClient
    served: ServedModel
    pool: RendererPool
    max_model_len: int | None
    reasoning_field: str
    sampling_overrides: dict[str, Any]
    sampling_mask: bool
    logprobs_mode: str
    use_raw_content: bool
    keep_special_tokens: bool
    generation_defaults: dict[str, Any]
    stop_token_ids: list[int]
    think_end: int | None

    @property
    def skip_special_tokens(self) -> bool:
        return not self.keep_special_tokens

    def reasoning_keys(self) -> tuple[str, ...]:
        """The reasoning keys a Chat Completions reply answers (`--reasoning-field`)."""
        if self.use_raw_content:
            return ()
        if self.reasoning_field == "both":
            return ("reasoning_content", "reasoning")
        return (self.reasoning_field,)

"""The token-mode options, declared once: ServerOptions inherits them and TokenBackend takes them.

Each option's flag (for `skycap serve` and mitmdump) is a row of skycap/server/flags.py's
table; what a turn reads of them, checked, is skycap.tokens.settings.TokenSettings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class TokenOptions:
    """What a token-mode server is built from; `upstream_url` may be given positionally.

    `renderer` is a ready renderer object (instead of `tokenizer`), `engine` the engine wire
    object (`None`: vLLM's, skycap.tokens.engine.VLLMEngine).
    """

    upstream_url: str | None = None
    _: KW_ONLY
    api_key: str | None = None
    tokenizer: str | None = None
    renderer: Any = None
    renderer_pool_size: int = 8
    render_cache_mib: int = 256
    renderer_name: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    engine: Any = None
    model: str | None = None
    max_model_len: int | None = None
    sampling_overrides: Mapping[str, Any] | None = None
    sampling_mask: bool = False
    logprobs_mode: str = "processed_logprobs"
    use_raw_content: bool = False
    keep_special_tokens: bool = False
    generation_config: str | None = None
    reasoning_field: str = "both"
    upstream_timeout: float | None = None


#: The keywords of TokenOptions, which TokenBackend accepts and reads from ServerOptions.
OPTION_NAMES = tuple(f.name for f in fields(TokenOptions))

"""The `renderers` library's side of token mode: loading a tokenizer, the renderer names it
knows, the name a tokenizer calls for, and building its renderer (thinking retention "all")."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skycap.tokens.renderer import RenderError
from skycap.tokens.tokenizer_env import (
    TokenizerUnavailable,
    quiet_transformers_import,
    tokenizer_source,
)


def load_tokenizer(name: str) -> Any:
    """A local folder or a hub name; an unreachable hub is refused in seconds (or the cache
    used) rather than retried for minutes (tokenizer_env.tokenizer_source)."""
    from huggingface_hub.utils import logging as hub_logging

    # The hub logs through a handler of its own and the root's too: each warning once.
    hub_logging.disable_propagation()
    try:
        source = tokenizer_source(name)  # before transformers' import, which takes seconds
    except TokenizerUnavailable as exc:
        raise RenderError(str(exc)) from None
    quiet_transformers_import()
    from renderers.base import load_tokenizer

    try:
        return load_tokenizer(source)
    except Exception as exc:  # transformers raises OSError, ValueError, HF hub errors, ...
        offline = (
            " (HF_HUB_OFFLINE is set, so a hub name is read from the cache only)"
            if os.environ.get("HF_HUB_OFFLINE")
            else ""
        )
        raise RenderError(
            f"cannot load tokenizer {name!r}{offline}: {type(exc).__name__}: {exc}. "
            "Pass a local folder holding tokenizer.json, or a hub name"
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


def resolve_renderer_name(renderer_name: str | None, source: str) -> str | None:
    """The renderer name asked for, or (None or "auto") the one `source` calls for."""
    return renderer_name if renderer_name not in (None, "auto") else infer_renderer_name(source)


def create_library_renderer(
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

    name = resolve_renderer_name(renderer_name, source)
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

"""What produced a record beyond the weights (format.md §4, "provenance"): package versions,
the tokenizer and a digest of its files, the chat template's digest, the renderer, and the
engine's served model and release.

A record made with another chat template or tokenizer than the trainer's is silently
wrong training data; the digests let `skycap check --reproduce` say so before re-rendering.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path
from typing import Any

#: The files of a tokenizer folder that decide its token ids and chat template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _versions() -> tuple[tuple[str, str | None], ...]:
    return tuple((name, package_version(name)) for name in ("skycap", "renderers", "transformers"))


def versions() -> dict[str, str | None]:
    """The versions of skycap and of the libraries that render its prompts (looked up once:
    a trajectory is created on the event loop)."""
    return dict(_versions())


def tokenizer_digest(name: str, tokenizer: Any) -> str:
    """`sha256:` of the tokenizer folder's files (name and bytes, in order) when `name` is a
    folder, else of the loaded tokenizer's serialised form (a hub name resolved by
    transformers): the same tokenizer always gives the same digest."""
    digest = hashlib.sha256()
    folder = Path(name).expanduser()
    if folder.is_dir():
        for file in TOKENIZER_FILES:
            path = folder / file
            if path.is_file():
                digest.update(file.encode() + b"\0" + path.read_bytes() + b"\0")
        return "sha256:" + digest.hexdigest()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else repr(tokenizer).encode())
    digest.update(b"\0" + text_digest(getattr(tokenizer, "chat_template", None)).encode())
    return "sha256:" + digest.hexdigest()


def text_digest(text: Any) -> str:
    """`sha256:` of a chat template (a string, or a mapping of named templates), or ""."""
    if isinstance(text, dict):
        text = "\0".join(f"{k}\0{v}" for k, v in sorted(text.items()))
    if not isinstance(text, str):
        return ""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def renderer_provenance(renderer: Any) -> dict[str, Any]:
    """The renderer's part: its own `provenance()` when it has one (the library renderer
    does), else what any renderer says (its class and name)."""
    own = getattr(renderer, "provenance", None)
    if callable(own):
        return dict(own())
    return {
        "tokenizer": {"name": getattr(renderer, "name", None), "digest": None},
        "chat_template_digest": None,
        "renderer": f"{type(renderer).__module__}.{type(renderer).__qualname__}",
    }


def token_provenance(
    rendered_by: dict[str, Any], model: str | None, engine_version: str | None
) -> dict[str, Any]:
    """A token-mode record's provenance (format.md §4) from the renderer's part."""
    return {
        **versions(),
        **rendered_by,
        "engine": {"model": model, "version": engine_version},
    }

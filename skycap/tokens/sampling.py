"""Token-mode sampling rules: vLLM's own validation, the model's generation defaults, mask limits.

skycap checks what vLLM would refuse before it calls the engine, so the harness gets a 400
naming the field instead of a 502 quoting the engine. Each rule names the vLLM source it
mirrors (0.33.0; 0.26.0 has the same sampling rules and no cache-salt or mask checks).
Generation defaults mirror vLLM's chat endpoint, which fills omitted fields from the
model's `generation_config.json` (config/model.py `get_diff_sampling_param`); the generate
route does not, so skycap does it for the harness.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: config/model.py `get_diff_sampling_param`: the generation_config.json fields vLLM reads,
#: with `max_new_tokens` meaning `max_tokens`. (`skip_special_tokens` is decoding, not
#: sampling: skycap exposes it as its own setting.)
GENERATION_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
#: entrypoints/generate/base/protocol.py `validate_cache_salt` (0.33).
CACHE_SALT_MAX = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


class SamplingError(ValueError):
    """A sampling value vLLM would refuse; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _number(sampling: Mapping[str, Any], key: str) -> float | None:
    value = sampling.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingError(f"{key} must be a number, got {value!r}", key)
    if not math.isfinite(value):
        raise SamplingError(f"{key} must be a finite number, got {value!r}", key)
    return float(value)


def _integer(sampling: Mapping[str, Any], key: str) -> int | None:
    value = sampling.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"{key} must be an integer, got {value!r}", key)
    return value


def _check_range(key: str, value: float | None, ok: bool, interval: str) -> None:
    if value is not None and not ok:
        shown = int(value) if float(value).is_integer() else value
        raise SamplingError(f"{key} must be in {interval}, got {shown}", key)


def validate_sampling(sampling: Mapping[str, Any]) -> None:
    """Refuse what vLLM's `SamplingParams._verify_args` (sampling_params.py) refuses.

    `sampling` is the merged dict sent to the engine (caller, generation defaults and
    overrides); raises SamplingError naming the first bad field.
    """
    for key in ("presence_penalty", "frequency_penalty"):
        value = _number(sampling, key)
        _check_range(key, value, value is None or -2.0 <= value <= 2.0, "[-2, 2]")
    value = _number(sampling, "repetition_penalty")
    _check_range("repetition_penalty", value, value is None or value > 0.0, "(0, inf)")
    value = _number(sampling, "temperature")
    _check_range("temperature", value, value is None or 0.0 <= value <= 2.0, "[0, 2]")
    value = _number(sampling, "top_p")
    _check_range("top_p", value, value is None or 0.0 < value <= 1.0, "(0, 1]")
    top_k = _integer(sampling, "top_k")
    if top_k is not None and top_k < -1:  # "quietly accept -1 as disabled, but prefer 0"
        raise SamplingError(f"top_k must be 0 (disable), or at least 1, got {top_k}", "top_k")
    value = _number(sampling, "min_p")
    _check_range("min_p", value, value is None or 0.0 <= value <= 1.0, "[0, 1]")
    max_tokens = _integer(sampling, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise SamplingError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    min_tokens = _integer(sampling, "min_tokens")
    if min_tokens is not None and min_tokens < 0:
        raise SamplingError(f"min_tokens must be at least 0, got {min_tokens}", "min_tokens")
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise SamplingError(
            f"min_tokens must be at most max_tokens={max_tokens}, got {min_tokens}", "min_tokens"
        )
    _integer(sampling, "seed")
    stop_strings(sampling)


def stop_strings(sampling: Mapping[str, Any]) -> list[str]:
    """The request's stop strings as a list (sampling_params.py `__post_init__`: a string is
    one stop; `_verify_args`: none may be empty)."""
    stop = sampling.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise SamplingError(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    if any(not s for s in stop):
        raise SamplingError("stop cannot contain an empty string", "stop")
    return list(stop)


def validate_cache_salt(value: Any) -> None:
    """generate/base/protocol.py `validate_cache_salt` (0.33): a non-empty string of at most
    128 characters without `@`, `/`, `\\` or NUL (None is no salt)."""
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise SamplingError(f"cache_salt must be a non-empty string, got {value!r}", "cache_salt")
    if len(value) > CACHE_SALT_MAX or CACHE_SALT_FORBIDDEN & set(value):
        raise SamplingError(
            f"cache_salt must be at most {CACHE_SALT_MAX} characters and must not contain "
            f"'@', '/', '\\\\' or NUL, got {value[:40]!r}{'…' if len(value) > 40 else ''}",
            "cache_salt",
        )


def check_mask_constraints(sampling: Mapping[str, Any], source: str) -> None:
    """With masks on, vLLM refuses temperature <= 0 and top_k <= 0 (v1/engine/input_processor.py,
    under `return_sampling_mask`); SamplingParams defaults are temperature 1.0, top_k 0.

    `source` says where the values come from, for the message ("this request", "the
    sampling overrides").
    """
    temperature = sampling.get("temperature", 1.0)
    numeric = isinstance(temperature, int | float) and not isinstance(temperature, bool)
    if not numeric or temperature <= 0:
        raise SamplingError(
            f"sampling masks need temperature > 0, but {source} has temperature "
            f"{temperature!r}; the engine (started with --return-sampling-mask) refuses it",
            "temperature",
        )
    top_k = sampling.get("top_k", 0)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0:
        shown = "unset (0, no limit)" if "top_k" not in sampling else repr(top_k)
        raise SamplingError(
            f"sampling masks need top_k > 0, but {source} has top_k {shown}; set top_k in "
            "the request or in --sampling-overrides (the engine started with "
            "--return-sampling-mask refuses it)",
            "top_k",
        )


def load_generation_config(
    setting: str | None, folders: list[Path]
) -> tuple[dict[str, Any], str | None]:
    """(sampling defaults, the file they came from) for `--generation-config auto|none|PATH`.

    `auto` reads `generation_config.json` from the first of `folders` (the model or tokenizer
    folder) that has one, and is empty when none does; `none` is empty; a PATH is a file or a
    folder holding `generation_config.json`, and must exist.
    """
    setting = setting or "auto"
    if setting == "none":
        return {}, None
    if setting == "auto":
        for folder in folders:
            candidate = folder / "generation_config.json"
            if candidate.is_file():
                return _read_generation_config(candidate), str(candidate)
        return {}, None
    path = Path(setting).expanduser()
    if path.is_dir():
        path = path / "generation_config.json"
    if not path.is_file():
        raise ValueError(
            f"generation_config {setting!r}: no such file (pass auto, none, a "
            "generation_config.json file or a folder holding one)"
        )
    return _read_generation_config(path), str(path)


def _read_generation_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation_config {str(path)!r} cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"generation_config {str(path)!r} must hold a JSON object")
    defaults = {
        ours: config[theirs]
        for theirs, ours in GENERATION_FIELDS.items()
        if config.get(theirs) is not None
    }
    try:
        validate_sampling(defaults)
    except SamplingError as exc:
        raise ValueError(f"generation_config {str(path)!r}: {exc}") from exc
    return defaults


def check_overrides(overrides: Mapping[str, Any], sampling_mask: bool) -> None:
    """`--sampling-overrides` values vLLM would refuse fail at start, naming the field."""
    try:
        validate_sampling(overrides)
        if sampling_mask and {"temperature", "top_k"} & set(overrides):
            check_mask_constraints(
                {"temperature": 1.0, "top_k": 1, **overrides}, "--sampling-overrides"
            )
    except SamplingError as exc:
        raise ValueError(f"sampling_overrides.{exc.param}: {exc}") from exc


def generation_folders(tokenizer: str | None) -> list[Path]:
    """Where `--generation-config auto` looks: the tokenizer folder, or a cached hub copy."""
    if tokenizer is None:
        return []
    folder = Path(tokenizer).expanduser()
    if folder.is_dir():
        return [folder]
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return []
    cached = try_to_load_from_cache(tokenizer, "generation_config.json")
    return [Path(cached).parent] if isinstance(cached, str) else []

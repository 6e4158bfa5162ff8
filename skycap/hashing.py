"""Canonical JSON and the digests that name messages, tools and nodes (graph.md §2, §3).

These values are stored in records and compared across tools, so every recipe here is
pinned by test vectors: change nothing without changing the format version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

RENDERED_FIELDS = (
    "role",
    "content",
    "reasoning_content",
    "reasoning",
    "name",
    "tool_calls",
    "tool_call_id",
    "tool_responses",
    "task",
    "wo_eos",
    "response_format",
)
TOOL_CALL_FIELDS = ("id", "function", "name", "arguments", "tool_call_id")
FUNCTION_FIELDS = ("name", "arguments")
SAMPLING_KEY_FIELDS = ("temperature", "top_p", "top_k", "min_p")


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, raw UTF-8, shortest round-trip floats (orjson >= 3.11.7)."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def digest(value: Any) -> str:
    return _blake(canonical_json(value))


def bytes_digest(data: bytes) -> str:
    """BLAKE2b-16 of raw bytes; the retry cache keys request bodies with it."""
    return _blake(data)


def token_digest(ids: Sequence[int] | np.ndarray) -> str:
    """Digest of token ids as consecutive signed 64-bit little-endian integers."""
    return _blake(np.asarray(ids, dtype="<i8").tobytes())


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, (list, dict)) and not value)


def canonical_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop top-level null, [] and {}; nested empties and empty strings stay."""
    # `_is_empty` inline: every message of every call passes here.
    return {
        k: v for k, v in message.items() if v is not None and (v or not isinstance(v, (list, dict)))
    }


def loose_fields(message: Mapping[str, Any]) -> dict[str, Any]:
    """Rendered fields with empty strings dropped too: what a respelling may differ in."""
    return {k: v for k, v in rendered_fields(message).items() if not _is_empty(v) and v != ""}


def _pick(obj: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    return {k: obj[k] for k in keys if k in obj}


def rendered_fields(message: Mapping[str, Any]) -> dict[str, Any]:
    """Keep only what a chat template reads (graph.md §3), then the canonical form."""
    out = _pick(message, RENDERED_FIELDS)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        kept = []
        for call in calls:
            if isinstance(call, dict):
                call = _pick(call, TOOL_CALL_FIELDS)
                if isinstance(call.get("function"), dict):
                    call["function"] = _pick(call["function"], FUNCTION_FIELDS)
            kept.append(call)
        out["tool_calls"] = kept
    return canonical_message(out)


def message_hash(message: Mapping[str, Any]) -> str:
    return digest(canonical_message(message))


def tools_hash(tools: Any) -> str:
    """Digest of the tool list as sent, or "" when there is no non-empty list."""
    return digest(tools) if isinstance(tools, list) and tools else ""


def model_key(model: Any) -> str:
    return model if isinstance(model, str) else ""


def text_match(message: Mapping[str, Any], tools_key: str, model: str) -> str:
    return digest([message_hash(message), tools_key, model])


class Remembered:
    """`text_match` and `tools_hash`, remembered by canonical JSON for one trajectory.

    Each call of a trajectory resends its whole conversation and tool list, so without
    this a call would hash every earlier message and the tools again: with it, only what
    is new. The canonical JSON is what each digest is taken of, so a remembered value is
    the one the recipe gives, by construction.
    """

    __slots__ = ("_matches", "_tools")

    def __init__(self) -> None:
        self._matches: dict[tuple[str, str], dict[bytes, str]] = {}
        self._tools: dict[bytes, str] = {}

    def text_match(self, message: Mapping[str, Any], tools_key: str, model: str) -> str:
        known = self._matches.get((tools_key, model))
        if known is None:
            known = self._matches[(tools_key, model)] = {}
        canonical = canonical_json(canonical_message(message))
        match = known.get(canonical)
        if match is None:
            match = known[canonical] = digest([_blake(canonical), tools_key, model])
        return match

    def tools_hash(self, tools: Any) -> str:
        if not isinstance(tools, list) or not tools:
            return ""
        canonical = canonical_json(tools)
        key = self._tools.get(canonical)
        if key is None:
            key = self._tools[canonical] = _blake(canonical)
        return key


def token_match(message: Mapping[str, Any], tools_key: str, model: str) -> str:
    return digest([digest(rendered_fields(message)), tools_key, model])


def sampling_key(sampling: Mapping[str, Any]) -> dict[str, Any]:
    return {k: sampling[k] for k in SAMPLING_KEY_FIELDS if sampling.get(k) is not None}


def text_model_delta(match: str, sampling: Mapping[str, Any]) -> str:
    return digest(["model", match, sampling_key(sampling)])


def token_client_delta(
    match: str, ids: Sequence[int] | np.ndarray, media: Sequence[Sequence[Any]] = ()
) -> str:
    parts: list[Any] = ["client", match, token_digest(ids)]
    if media:
        parts.append([list(m) for m in media])
    return digest(parts)


def token_model_delta(
    match: str, sampling: Mapping[str, Any], sampled_start: int, ids: Sequence[int] | np.ndarray
) -> str:
    return digest(["model", match, sampling_key(sampling), sampled_start, token_digest(ids)])

"""The token-neutral spellings every dialect folds away before hashing (docs/format.md).

A harness re-sends what skycap answered in its own spelling: a single text block for a
string, `cache_control` markers that move every turn, the OpenAI SDK stream helper's extra
keys, `reasoning` for `reasoning_content`. Canonicalising both what is answered and what is
re-sent to one form keeps a replayed history on one path.
"""

from __future__ import annotations

from typing import Any

#: Keys dropped from every content part (they change no token).
PART_DROPPED = ("cache_control",)
#: Keys the OpenAI SDK's `chat.completions.stream()` helper adds to an echoed message.
SDK_MESSAGE_DROPPED = ("parsed",)
SDK_CALL_DROPPED = ("index",)
SDK_FUNCTION_DROPPED = ("parsed_arguments",)


#: The keys a content part may have and still be plain text.
_TEXT_PART_KEYS = frozenset(("type", "text", *PART_DROPPED))


def text_of(parts: list[Any]) -> str | None:
    """The string a content list means when it is exactly one text block, else None."""
    if len(parts) == 1:
        part = parts[0]
        if (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            if _TEXT_PART_KEYS.issuperset(part):
                return part["text"]
    return None


def content(value: Any) -> Any:
    """Canonical content: one text block is its string; parts lose their markers."""
    if not isinstance(value, list):
        return value
    single = text_of(value)
    if single is not None:
        return single
    return [_part(p) for p in value]


def _part(part: Any) -> Any:
    if isinstance(part, dict) and any(k in part for k in PART_DROPPED):
        return {k: v for k, v in part.items() if k not in PART_DROPPED}
    return part


def fold_reasoning(message: dict[str, Any]) -> None:
    """`reasoning` (vLLM's newer name) becomes `reasoning_content`, in place."""
    if "reasoning" in message:
        reasoning = message.pop("reasoning")
        if message.get("reasoning_content") is None and reasoning is not None:
            message["reasoning_content"] = reasoning


def chat_message(message: dict[str, Any]) -> dict[str, Any]:
    """A Chat Completions message in canonical form (a new dict; the input is untouched)."""
    out = {k: v for k, v in message.items() if k not in SDK_MESSAGE_DROPPED}
    if "content" in out:
        out["content"] = content(out["content"])
    fold_reasoning(out)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_call(c) for c in calls]
    return out


def _call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    out = {k: v for k, v in call.items() if k not in SDK_CALL_DROPPED}
    function = out.get("function")
    if isinstance(function, dict) and any(k in function for k in SDK_FUNCTION_DROPPED):
        out["function"] = {k: v for k, v in function.items() if k not in SDK_FUNCTION_DROPPED}
    return out

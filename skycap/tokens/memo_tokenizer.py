"""The tokenizer as the library renderer sees it, with the encodes of short texts memoised."""

from __future__ import annotations

import functools
from typing import Any

from skycap.tokens.tokenizer_env import quiet_transformers_import

#: Texts up to this many characters have their encodes memoised per renderer (MemoTokenizer).
MEMO_MAX_CHARS = 64
#: Distinct short texts remembered per renderer; the least recently used go first.
MEMO_ENTRIES = 1024
_ENCODE_KEYWORDS = {"add_special_tokens": False}
_OFFSETS_KEYWORDS = {"add_special_tokens": False, "return_offsets_mapping": True}


class MemoTokenizer:
    """The tokenizer as the library renderer sees it: encodes of short texts are memoised.

    The library encodes the same template pieces ("\\n", "user", "assistant\\n", its
    "<|im_start|>assistant\\n" header, an offsets probe "a") about a dozen times per bridge,
    each a full transformers call, which made them most of a small bridge's cost.
    Only texts of at most MEMO_MAX_CHARS characters called with exactly the library's
    keywords are memoised, in a bounded LRU, and every call gets fresh lists, so a caller
    mutating a result cannot change a later one. Anything else goes to the wrapped tokenizer.
    Each renderer (pool slot) has its own; `functools.lru_cache` is thread-safe regardless.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._inner = tokenizer
        self._encode = functools.lru_cache(maxsize=MEMO_ENTRIES)(self._encode_once)
        self._offsets = functools.lru_cache(maxsize=MEMO_ENTRIES)(self._offsets_once)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        if _memoisable(text, args, kwargs, _ENCODE_KEYWORDS):
            return list(self._encode(text))
        return self._inner.encode(text, *args, **kwargs)

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        """A memoised call answers a BatchEncoding of fresh lists, without Rust encodings."""
        if _memoisable(text, args, kwargs, _OFFSETS_KEYWORDS):
            quiet_transformers_import()
            from transformers import BatchEncoding

            return BatchEncoding({key: list(value) for key, value in self._offsets(text)})
        return self._inner(text, *args, **kwargs)

    def _encode_once(self, text: str) -> tuple[int, ...]:
        return tuple(self._inner.encode(text, add_special_tokens=False))

    def _offsets_once(self, text: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        out = self._inner(text, add_special_tokens=False, return_offsets_mapping=True)
        return tuple((key, tuple(value)) for key, value in out.items())


def _memoisable(
    text: Any, args: tuple[Any, ...], kwargs: dict[str, Any], keywords: dict[str, Any]
) -> bool:
    return not args and kwargs == keywords and type(text) is str and len(text) <= MEMO_MAX_CHARS

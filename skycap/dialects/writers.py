"""The streamed token-mode writer of a reply, asked of its dialect (see `StreamWriter`)."""

from __future__ import annotations

from collections.abc import Sequence

from skycap.dialects import Dialect, ReplyData, StreamWriter


def stream_writer(dialect: Dialect, head: ReplyData, reasoning_keys: Sequence[str]) -> StreamWriter:
    """A writer for one reply; `head` holds its id, model, prompt size and request, and
    `reasoning_keys` the reasoning keys a Chat Completions reply answers."""
    return dialect.stream_writer(head, reasoning_keys)

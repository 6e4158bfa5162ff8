"""The streamed token-mode writer of each dialect, by dialect (see `StreamWriter`)."""

from __future__ import annotations

from collections.abc import Sequence

from skycap.dialects import Dialect, ReplyData, StreamWriter
from skycap.dialects.chat_writer import ChatWriter
from skycap.dialects.messages_writer import MessagesWriter
from skycap.dialects.responses_writer import ResponsesWriter


def stream_writer(dialect: Dialect, head: ReplyData, reasoning_keys: Sequence[str]) -> StreamWriter:
    """A writer for one reply; `head` holds its id, model, prompt size and request, and
    `reasoning_keys` the reasoning keys a Chat Completions reply answers."""
    if dialect.name == "messages":
        return MessagesWriter(head)
    if dialect.name == "responses":
        return ResponsesWriter(head)
    if dialect.name == "chat":
        return ChatWriter(head, reasoning_keys)
    raise ValueError(f"no stream writer for dialect {dialect.name!r}")

"""Token-mode answers: the reply message, JSON body and synthesised SSE (http.md §9.5-9.7)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from skycap.tokens.renderer import Renderer, parse_reply, raw_content


def reply_messages(
    renderer: Renderer,
    completion_ids: Sequence[int],
    tools: list[Any] | None,
    prompt_ids: Sequence[int],
    *,
    use_raw_content: bool,
    skip_special_tokens: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(message stored on the model node, message answered to the harness).

    Parsed replies are stored as answered. Raw content (`--use-raw-content`) stores only
    role and content and answers with `reasoning_content: null` as well, so a harness that
    replays `content` verbatim stays on one path. Runs on a renderer worker thread.
    """
    if use_raw_content:
        stored = {
            "role": "assistant",
            "content": raw_content(
                renderer, completion_ids, prompt_ids, skip_special_tokens=skip_special_tokens
            ),
        }
        return stored, {**stored, "reasoning_content": None}
    message = parse_reply(renderer, completion_ids, tools, prompt_ids)
    return message, message


def finish_reason(engine_reason: str, message: dict[str, Any]) -> str:
    """The engine's reason, except `stop` becomes `tool_calls` when the reply calls tools."""
    if engine_reason == "stop" and message.get("tool_calls"):
        return "tool_calls"
    return engine_reason


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class Completion:
    """One answered completion; `json()` and `sse()` are its two wire forms (http.md §9.6-9.7)."""

    id: str
    created: int
    model: str
    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    def json(self) -> bytes:
        """The non-streamed `chat.completion` body (http.md §9.6)."""
        choice = {
            "index": 0,
            "finish_reason": self.finish_reason,
            "logprobs": None,
            "message": self.message,
        }
        return orjson.dumps(
            {**self._head("chat.completion"), "choices": [choice], "usage": self._usage()}
        )

    def sse(self, *, include_usage: bool = False) -> bytes:
        """The whole synthesised stream as one buffered body (http.md §9.7).

        Usage comes as a last `choices: []` chunk, only when the request asked for it with
        `stream_options.include_usage` (as OpenAI and vLLM send it).
        """
        head = self._head("chat.completion.chunk")

        def frame(delta: dict[str, Any], reason: str | None = None, **extra: Any) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
            return b"data: " + orjson.dumps({**head, "choices": [choice], **extra}) + b"\n\n"

        message = self.message
        frames = [frame({"role": "assistant"})]
        if message.get("reasoning_content"):
            frames.append(frame({"reasoning_content": message["reasoning_content"]}))
        if message.get("content"):
            frames.append(frame({"content": message["content"]}))
        for index, call in enumerate(message.get("tool_calls") or ()):
            frames.append(frame({"tool_calls": [{"index": index, **call}]}))
        frames.append(frame({}, self.finish_reason))
        if include_usage:
            usage = {**head, "choices": [], "usage": self._usage()}
            frames.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        frames.append(b"data: [DONE]\n\n")
        return b"".join(frames)

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

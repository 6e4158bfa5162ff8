"""A streamed engine reply read chunk by chunk into the same EngineOutput a full reply gives.

vLLM's streamed generate route (token_in_token_out/serving.py
`serve_tokens_stream_generator`, 0.26 and 0.33) sends one `data:` JSON chunk per engine
step: `choices[0]` carries that step's `token_ids`, their `logprobs.content` entries and
`sampling_mask` rows (v1/engine/output_processor.py clears the mask chunks per delta);
the chunk with a `finish_reason` carries the whole `routed_experts` array (concatenated on
finish). A usage chunk (`choices: []`) and `data: [DONE]` end it; a failure inside the
stream arrives as a `data:` object with an `error`. Everything is kept in the order the
engine sent it, and the finished reply is validated by `VLLMEngine.parse`, so a streamed
and a non-streamed reply are read by one set of rules.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from skycap.tokens.engine import EngineError, EngineOutput, VLLMEngine, _routed_experts


class EngineStream:
    """Feed each decoded `data:` chunk; `finish()` gives the EngineOutput or raises EngineError."""

    def __init__(self, engine: VLLMEngine, routes_from: int) -> None:
        self.engine = engine
        self.routes_from = routes_from
        self.token_ids: list[int] = []
        self._logprobs: list[Any] = []
        self._mask: list[Any] | None = None
        self._experts: list[Any] = []
        self.finish_reason: Any = None
        self.finished = False
        #: The engine's id for this request (`request_id` of its chunks), for an abort.
        self.request_id: str | None = None
        self.chunks = 0

    def feed(self, chunk: Any) -> list[int]:
        """Read one chunk; returns the token ids it added (in engine order)."""
        if not isinstance(chunk, dict):
            raise EngineError(f"a stream chunk is not a JSON object: {chunk!r:.200}")
        if "error" in chunk and chunk.get("error") is not None:
            raise EngineError(f"the engine's stream reported an error: {chunk['error']!r:.500}")
        self.chunks += 1
        if isinstance(chunk.get("request_id"), str):
            self.request_id = chunk["request_id"]
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise EngineError(f"a stream chunk has no choices list: {chunk!r:.200}")
        if not choices:
            return []  # the usage chunk
        if len(choices) != 1 or not isinstance(choices[0], dict):
            raise EngineError("expected exactly one choice in each stream chunk")
        if self.finished:
            raise EngineError("the engine's stream sent tokens after its finish reason")
        choice = choices[0]
        ids = choice.get("token_ids") or []
        if not isinstance(ids, list):
            raise EngineError(f"a stream chunk's token_ids is not a list: {ids!r:.200}")
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if ids and not isinstance(content, list):
            raise EngineError(
                "the engine streamed tokens without sampled-token logprobs; token capture "
                "requires them"
            )
        self.token_ids.extend(ids)
        self._logprobs.extend(content or ())
        mask = choice.get("sampling_mask")
        if mask is not None:
            if not isinstance(mask, list):
                raise EngineError(f"sampling_mask must be a list of rows, got {mask!r:.200}")
            self._mask = (self._mask or []) + mask
        experts = choice.get("routed_experts")
        if experts is not None:
            self._experts.append(experts)
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish_reason = reason
            self.finished = True
        return ids

    def finish(self, *, stopped: bool = False) -> EngineOutput:
        """The whole reply, checked as a non-streamed one is; EngineError if it cannot be used.

        A stream without a finish reason broke off: it is never a short completion. With
        `stopped` (skycap cut a stop string and aborted the request), whatever finish the
        engine sent (`abort`, or none when the stream closed) reads as `stop`; the caller
        cuts the tokens at the stop string.
        """
        if not self.finished and not stopped:
            raise EngineError(
                f"the engine's stream ended without a finish reason after {len(self.token_ids)} "
                f"tokens in {self.chunks} chunks; nothing was committed, retry the call"
            )
        choice: dict[str, Any] = {
            "token_ids": self.token_ids,
            "logprobs": {"content": self._logprobs},
            "finish_reason": "stop" if stopped else self.finish_reason,
            "sampling_mask": self._mask,
        }
        if len(self._experts) == 1:
            choice["routed_experts"] = self._experts[0]
        output = self.engine.parse({"choices": [choice]}, routes_from=self.routes_from)
        if len(self._experts) > 1:
            arrays = [_routed_experts(part) for part in self._experts]
            output.routed_experts = np.concatenate([a for a, _ in arrays], axis=0)
            if arrays[0][1] is not None:
                output.routed_start = arrays[0][1]
        return output

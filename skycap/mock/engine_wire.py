"""The wire shapes of vLLM's generate route as the scripted engine writes them.

Deterministic logprobs and routed experts (so a test can tell which position a stored
value came from), the experts' base64 `.npy` encoding, each version's logprob entry, the
chunks of a streamed reply and vLLM's error body.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

#: vLLM's "no logprob" value (token_in_token_out/serving.py `_clamp_logprob`).
MISSING_LOGPROB = -9999.0
#: Distinct expert ids the scripted router picks from.
NUM_EXPERTS = 64


def scripted_logprob(token_id: int, position: int) -> float:
    """The logprob the engine reports for `token_id` sampled at absolute `position`."""
    return -(((token_id + position) % 100) + 1) / 100


def scripted_experts(token_ids: Sequence[int], start: int, layers: int, k: int) -> np.ndarray:
    """Routed experts for positions [start, len-1) of a sequence: shape [rows, layers, k], uint8.

    Row p depends on the token at p and on p itself, so a test can tell which position a
    stored row came from.
    """
    ids = np.asarray(token_ids[start : len(token_ids) - 1], dtype=np.int64)
    pos = np.arange(start, start + len(ids), dtype=np.int64)
    base = (ids * 7 + pos * 3)[:, None, None]
    grid = base + np.arange(layers)[None, :, None] * 5 + np.arange(k)[None, None, :]
    return (grid % NUM_EXPERTS).astype(np.uint8)


def npy_base64(array: np.ndarray) -> str:
    """Base64 of a `.npy` file, the engine's routed-experts encoding
    (docs/tokens.md "The engine: vLLM")."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def logprob_entry(version: str, token: int, value: float) -> dict[str, Any]:
    """One sampled-token entry in this version's shape (logprobs=0: no alternatives)."""
    if version == "0.26":
        # 0.26 token_in_token_out/serving.py `_create_tokens_logprobs`
        entry = {"token": f"token_id:{token}", "logprob": value, "bytes": None}
        return {**entry, "top_logprobs": [entry]}
    # 0.33 token_in_token_out/serving.py `_create_tokens_logprobs`
    entry = {"token_id": token, "logprob": value, "rank": 1}
    return {**entry, "top_logprobs": [entry]}


def stream_chunks(body: dict[str, Any], answer: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """The reply as 0.33's stream sends it (token_in_token_out/serving.py
    `serve_tokens_stream_generator`, chunk shape protocol.py GenerateTokensStreamResponse):
    one chunk per engine step with its token ids, logprob entries and mask rows; the
    last carries the finish reason, stop reason and the whole routed-experts array
    (v1/engine/output_processor.py concatenates them on finish); a usage chunk only
    with `stream_options.include_usage`. `step` is the tokens per chunk."""
    request_id = f"generate-tokens-{body.get('request_id') or answer['request_id']}"
    if not answer["choices"]:
        return [{"request_id": request_id, "choices": []}]
    choice = answer["choices"][0]
    ids, entries = choice["token_ids"], (choice["logprobs"] or {}).get("content")
    mask = choice.get("sampling_mask")
    step = max(step, 1)
    chunks = []
    for start in range(0, max(len(ids), 1), step):
        part: dict[str, Any] = {
            "index": 0,
            "logprobs": None if entries is None else {"content": entries[start : start + step]},
            "finish_reason": None,
            "stop_reason": None,
            "token_ids": ids[start : start + step],
            "routed_experts": None,
            "sampling_mask": None if mask is None else mask[start : start + step],
            "weight_versions": None,
        }
        chunks.append(
            {
                "request_id": request_id,
                "output_mode": "tokens",
                "usage": None,
                "choices": [part],
            }
        )
    last = chunks[-1]["choices"][0]
    last["finish_reason"] = choice["finish_reason"]
    last["stop_reason"] = choice.get("stop_reason")
    last["routed_experts"] = choice["routed_experts"]
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        chunks.append(
            {
                "request_id": request_id,
                "output_mode": "tokens",
                "choices": [],
                "usage": answer["usage"],
            }
        )
    return chunks


def error_body(
    message: str, kind: str = "BadRequestError", code: int = 400, param: str | None = None
) -> bytes:
    """vLLM's ErrorResponse body (entrypoints/serve/engine/protocol.py)."""
    return json_bytes({"error": {"message": message, "type": kind, "param": param, "code": code}})


def json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()

"""The engine wire: sampling merge, the vLLM `/inference/v1/generate` request body and reply reader.

No HTTP happens here; the turn runner posts `VLLMEngine.request(...)` and hands the decoded
JSON to `VLLMEngine.parse(...)` (http.md §3.2, docs/tokens.md "The engine: vLLM", and
docs/tokens.md "Engines and renderers"). Other engines subclass VLLMEngine.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from skycap.arrays import PackedArrayError, unpack

EXPERT_DTYPES = ("uint8", "uint16")
#: Older vLLM builds (and some >256-expert models) send int32 rows; they are narrowed to
#: uint16 when every id fits, which is lossless and the same dtype on every call.
WIDE_EXPERT_DTYPES = ("int32",)
#: vLLM's "no logprob" value (serving.py `_clamp_logprob` and the missing-entry default in
#: both versions); never a real logprob, so it is stored as NaN.
MISSING_LOGPROB = -9999.0
#: Finish reasons vLLM sends (v1/engine/__init__.py FINISH_REASON_STRINGS), as skycap reads
#: them: `repetition` (repetitive n-gram detection) is a normal stop; `abort` and
#: `error` are engine failures.
FINISH_AS = {"stop": "stop", "length": "length", "repetition": "stop"}
FAILED_FINISH = ("abort", "error")


class EngineError(Exception):
    """The engine's reply cannot be used; the turn answers 502 `engine: <message>`."""


@dataclass
class EngineOutput:
    """One completion as the engine reported it (docs/tokens.md "Engines and renderers")."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: np.ndarray | None = None
    routed_start: int = 0
    sampling_mask: list[list[int]] | None = None
    #: The engine's own finish reason when it differs from `finish_reason` (`repetition`).
    engine_finish_reason: str | None = None
    #: Rows per completion token of other sidecar kinds (skycap/record/sidecars.py), by the
    #: kind's field name; the commit gives the scaffold zero rows.
    extra: dict[str, np.ndarray] | None = None

    @property
    def missing_logprobs(self) -> int:
        """Sampled tokens the engine gave no logprob for (stored as NaN, loss mask 0)."""
        return sum(1 for value in self.logprobs if value != value)


def _fold_max_completion_tokens(side: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(side)
    if "max_completion_tokens" in out:
        out["max_tokens"] = out.pop("max_completion_tokens")
    return out


def merge_sampling(
    caller: Mapping[str, Any],
    overrides: Mapping[str, Any],
    *,
    room: int | None,
    stop_token_ids: Sequence[int],
) -> dict[str, Any]:
    """Merge caller parameters and `--sampling-overrides` (http.md §3.2).

    `room` is `max_model_len - len(prompt)` when `--max-model-len` is set, else None.
    The result includes `stop_token_ids` (the renderer's unless an override set them); the
    call records the dict *without* `stop_token_ids`.
    """
    merged = {**_fold_max_completion_tokens(caller), **_fold_max_completion_tokens(overrides)}
    if room is not None:
        limit = merged.get("max_tokens")
        if limit is None:
            merged["max_tokens"] = room
        elif isinstance(limit, bool) or not isinstance(limit, int):
            raise ValueError(f"max_tokens must be an integer, got {limit!r}")
        else:
            merged["max_tokens"] = min(limit, room)
    merged.setdefault("stop_token_ids", list(stop_token_ids))
    return merged


class VLLMEngine:
    """vLLM's generate wire; subclass and override attributes or hooks for other engines."""

    name: str = "vllm"
    generate_path: str = "/inference/v1/generate"
    release_path: str | None = None
    #: Where a streamed request is stopped early (a stop string completed): vLLM 0.33's
    #: token_in_token_out/api_router.py `abort_requests`; None: closing the stream is all.
    abort_path: str | None = "/inference/v1/abort_requests"
    routes_from_supported: bool = True
    sampling_keys: frozenset[str] = frozenset(
        {
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop_token_ids",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "min_tokens",
            "ignore_eos",
        }
    )

    def request(
        self,
        *,
        prompt_ids: Sequence[int],
        sampling: Mapping[str, Any],
        model: str | None,
        cache_salt: str | None,
        sampling_mask: bool,
        routes_from: int = 0,
        features: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The request body of docs/tokens.md "The engine: vLLM" for the merged `sampling` dict.

        Keys outside `sampling_keys` are dropped from the wire (they stay recorded);
        `logprobs: 0` is always sent. `stop` strings are never sent: a `--tokens-only` vLLM
        refuses them (token_in_token_out/serving.py `serve_tokens`) and skycap applies them
        itself (skycap.tokens.stops). `sampling_mask` is ignored: vLLM returns masks
        when started with `--return-sampling-mask`. `model` is the served name (learned or
        `--model`), never the harness's own name, which vLLM answers with 404.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids must be non-empty: the engine needs a prompt")
        if not 0 <= routes_from < len(prompt_ids):
            raise ValueError(
                f"routes_from must be in [0, {len(prompt_ids)}) for a {len(prompt_ids)}-token "
                f"prompt, got {routes_from}"
            )
        params = {k: v for k, v in sampling.items() if k in self.sampling_keys}
        params["logprobs"] = 0
        if self.routes_from_supported and routes_from > 0:
            params["routed_experts_prompt_start"] = routes_from
        body: dict[str, Any] = {"token_ids": list(prompt_ids), "sampling_params": params}
        if model:
            body["model"] = model
        if cache_salt:
            body["cache_salt"] = cache_salt
        if features:
            body["features"] = dict(features)
        return body

    def stream_request(self, body: Mapping[str, Any], request_id: str) -> dict[str, Any] | None:
        """The streamed form of a `request(...)` body, or None when this wire cannot stream.

        vLLM (0.26 and 0.33) streams the generate route with `stream: true`
        (token_in_token_out/serving.py `serve_tokens_stream_generator`): `data:` chunks of
        token-id deltas with their logprobs and mask rows, routed experts on the last one,
        then `[DONE]`. `request_id` names the request for `abort_path`. An engine whose wire
        has no stream returns None, and the reply is synthesised at the end instead.
        """
        return {**body, "stream": True, "request_id": request_id}

    def parse(self, body: Any, *, routes_from: int = 0) -> EngineOutput:
        """Validate the decoded reply (docs/tokens.md "The engine: vLLM"), then read side
        channels."""
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise EngineError("expected exactly one choice")
        choice = choices[0]
        completion = _completion_ids(choice.get("token_ids"))
        finish, engine_finish = _finish_reason(choice.get("finish_reason"))
        output = EngineOutput(
            completion_ids=completion,
            logprobs=_logprobs(choice.get("logprobs"), completion),
            finish_reason=finish,
            routed_start=routes_from if self.routes_from_supported else 0,
            engine_finish_reason=engine_finish,
        )
        self._side_channels(choice, output)
        return output

    def _side_channels(self, choice: Mapping[str, Any], output: EngineOutput) -> None:
        """Read `routed_experts` and `sampling_mask` from the choice into `output`."""
        experts = choice.get("routed_experts")
        if experts is not None:
            output.routed_experts, start = _routed_experts(experts)
            if start is not None:
                output.routed_start = start
        mask = choice.get("sampling_mask")
        if mask is not None:
            output.sampling_mask = _sampling_mask(mask, len(output.completion_ids))


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _completion_ids(ids: Any) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise EngineError("completion token ids are missing or empty")
    for i, token in enumerate(ids):
        if not _is_token_id(token):
            raise EngineError(
                f"completion token ids must be non-negative integers, got {token!r} at {i}"
            )
    return ids


def _finish_reason(value: Any) -> tuple[str, str | None]:
    """(skycap's finish reason, the engine's when it differs); abort and error raise."""
    if value is None:  # vLLM's choice default is "stop" (protocol.py GenerateChoiceBase)
        return "stop", None
    if not isinstance(value, str):
        raise EngineError(f"finish_reason must be a string, got {value!r}")
    if value in FAILED_FINISH:
        raise EngineError(
            f"the engine ended the request with finish_reason {value!r} (aborted or failed "
            "inside the engine); nothing was committed, retry the call"
        )
    mapped = FINISH_AS.get(value, value)
    return mapped, value if mapped != value else None


def _logprobs(logprobs: Any, completion: list[int]) -> list[float]:
    """One logprob per completion token, each checked against its token; -9999.0 is NaN.

    Reads both entry shapes: 0.33's `{"token_id": N, "logprob", "rank", "top_logprobs"}`
    (token_in_token_out/protocol.py GenerateLogProbsContent) and 0.26's OpenAI-style
    `{"token": "token_id:N", "logprob", "bytes", "top_logprobs"}` (0.26 serving.py
    `_create_tokens_logprobs`). An entry naming no token cannot be checked and is read as is.
    """
    n = len(completion)
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        raise EngineError(
            "the engine returned no sampled-token logprobs; token capture requires them"
        )
    values = [_logprob(entry) for entry in content]
    values = [v for v in values if v is not None]
    if len(values) != n or len(content) != n:
        raise EngineError(f"{n} completion tokens but {len(values)} logprobs")
    for i, (entry, token) in enumerate(zip(content, completion, strict=True)):
        named = _entry_token(entry)
        if named is not None and named != token:
            raise EngineError(
                f"logprob entry {i} is for token {named} but completion token {i} is {token}"
            )
    return values


def _logprob(entry: Any) -> float | None:
    value = entry.get("logprob") if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return math.nan if value <= MISSING_LOGPROB else value


def _entry_token(entry: dict[str, Any]) -> int | None:
    """The token id an entry names (either shape), or None when it names none."""
    token_id = entry.get("token_id")
    if token_id is not None:
        if not _is_token_id(token_id):
            raise EngineError(f"logprob entry token_id must be a token id, got {token_id!r}")
        return token_id
    token = entry.get("token")
    prefix = "token_id:"
    if isinstance(token, str) and token.startswith(prefix) and token[len(prefix) :].isdigit():
        return int(token[len(prefix) :])
    return None  # no id, or a decoded token string from an engine with a tokenizer


def _routed_experts(value: Any) -> tuple[np.ndarray, int | None]:
    """(array, explicit start or None) from a base64 `.npy` string or an array envelope."""
    if isinstance(value, str):
        array, start = _load_npy(value), None
    elif isinstance(value, dict):
        try:
            array = unpack(value)
        except PackedArrayError as exc:
            raise EngineError(str(exc)) from exc
        start = value.get("start")
        if start is not None and not _is_token_id(start):
            raise EngineError(
                f"invalid packed array: start must be a non-negative integer, got {start!r}"
            )
    else:
        raise EngineError(
            "routed_experts must be a base64 .npy string or an array envelope, "
            f"got {type(value).__name__}"
        )
    if array.dtype.name in WIDE_EXPERT_DTYPES:
        array = _narrow(array)
    if array.dtype.name not in EXPERT_DTYPES:
        raise EngineError(f"routed_experts dtype must be uint8, uint16 or int32, got {array.dtype}")
    return array.astype(array.dtype.newbyteorder("="), copy=False), start


def _narrow(array: np.ndarray) -> np.ndarray:
    """int32 expert ids as uint16, refusing any value that would not survive the cast."""
    if array.size and (int(array.min()) < 0 or int(array.max()) > np.iinfo(np.uint16).max):
        raise EngineError(
            f"routed_experts int32 ids must be in [0, 65535], got [{int(array.min())}, "
            f"{int(array.max())}]"
        )
    return array.astype(np.uint16)


def _load_npy(text: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text, validate=True)
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise EngineError(f"routed_experts: cannot decode the base64 .npy payload: {exc}") from exc


def _sampling_mask(mask: Any, n: int) -> list[list[int]]:
    if not isinstance(mask, list):
        raise EngineError(f"sampling_mask must be a list of rows, got {type(mask).__name__}")
    if len(mask) != n:
        raise EngineError(f"sampling_mask has {len(mask)} rows for {n} completion tokens")
    for i, row in enumerate(mask):
        if not isinstance(row, list) or not all(_is_token_id(t) for t in row):
            raise EngineError(f"sampling_mask row {i} must be a list of token ids, got {row!r}")
    return mask

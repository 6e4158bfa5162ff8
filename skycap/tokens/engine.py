"""The engine wire: what token mode says to an engine and how it reads the answers.

`EngineWire` is the protocol: the generate request body, the reply and stream-chunk
readers, the session header, the abort and release requests and the served-model lookup.
`VLLMEngine` speaks vLLM's `/inference/v1/generate` and is the default; another engine is
one module with a class of its own, chosen with `--engine-wire MODULE:CLASS`
(docs/tokens.md, "Engines and renderers"). No HTTP happens here: skycap.tokens.client
moves the bytes the wire names, and the turn hands the decoded replies back to it
(http.md §3.2, docs/tokens.md "The engine: vLLM").
"""

from __future__ import annotations

import base64
import binascii
import importlib
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import orjson

from skycap.arrays import PackedArrayError, unpack
from skycap.weights import Span, SpansError, clip_spans, read_spans

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
    #: Which weight version sampled which completion tokens (skycap/weights.py), or None
    #: when the engine did not say.
    weight_versions: list[Span] | None = None

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


class StreamReader(Protocol):
    """One streamed reply, read chunk by chunk into the EngineOutput a whole reply gives."""

    #: The completion's token ids so far, in engine order.
    token_ids: list[int]
    #: Whether a chunk carried the finish reason.
    finished: bool
    #: The engine's id for this request, for an abort, once a chunk named it.
    request_id: str | None

    def feed(self, chunk: Any) -> list[int]:
        """Read one decoded `data:` chunk; the token ids it added. Raises EngineError."""
        ...

    def finish(self, *, stopped: bool = False) -> EngineOutput:
        """The whole reply (`stopped`: skycap cut a stop string and aborted it)."""
        ...


class EngineWire(Protocol):
    """What token mode asks of an engine's wire; VLLMEngine is the one it uses by default."""

    #: Recorded as the trajectory's `capture.engine`.
    name: str
    #: The route generate requests are posted to (the stream too), from the engine root.
    generate_path: str
    #: The route listing the served models, from the engine root.
    models_path: str

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
        """The generate request body; ValueError for what the engine would refuse."""
        ...

    def stream_request(self, body: Mapping[str, Any], request_id: str) -> dict[str, Any] | None:
        """The streamed form of a `request(...)` body, or None when the wire cannot stream."""
        ...

    def parse(self, body: Any, *, routes_from: int = 0) -> EngineOutput:
        """Read a decoded generate reply; EngineError when it cannot be used."""
        ...

    def stream_reader(self, routes_from: int) -> StreamReader:
        """A reader for the chunks of one streamed reply."""
        ...

    def session_headers(self, session_id: str) -> dict[str, str]:
        """Headers naming the trajectory on each generate request (for sticky routing)."""
        ...

    def abort(self, request_id: str) -> tuple[str, dict[str, Any]] | None:
        """(route, JSON body) stopping a streamed request early, or None: closing is all."""
        ...

    def release(self, session_id: str) -> tuple[str, dict[str, str]] | None:
        """(route, query) dropping a finished session's engine state, or None."""
        ...

    def served_names(self, body: bytes) -> list[str]:
        """The served model names in the body of a 200 from `models_path`, in order."""
        ...


def load_wire(spec: str) -> EngineWire:
    """The wire `--engine-wire` names: `vllm`, or `MODULE:CLASS` built with no arguments."""
    if spec == VLLMEngine.name:
        return VLLMEngine()
    module, _, attribute = spec.partition(":")
    if not module or not attribute:
        raise ValueError(
            f"--engine-wire must be vllm or MODULE:CLASS (an importable class of an engine "
            f"wire), got {spec!r}"
        )
    try:
        wire = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--engine-wire {spec}: cannot import it: {exc}") from None
    try:
        return wire()
    except TypeError as exc:
        raise ValueError(
            f"--engine-wire {spec}: cannot build it with no arguments: {exc}; give a class "
            "whose constructor needs none"
        ) from None


class VLLMEngine:
    """vLLM's generate wire (EngineWire); a subclass may override attributes or hooks."""

    name: str = "vllm"
    generate_path: str = "/inference/v1/generate"
    models_path: str = "/v1/models"
    release_path: str | None = None
    #: Where the engine reports its release (entrypoints/serve/instrumentator/basic.py
    #: `show_version`), for each record's provenance; None: it does not.
    version_path: str | None = "/version"
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

    def stream_reader(self, routes_from: int) -> EngineStream:
        return EngineStream(self, routes_from)

    def session_headers(self, session_id: str) -> dict[str, str]:
        """vLLM's routers pin a session to one replica by `X-Session-ID`."""
        return {"X-Session-ID": session_id}

    def abort(self, request_id: str) -> tuple[str, dict[str, Any]] | None:
        if not self.abort_path:
            return None
        return self.abort_path, {"request_ids": [request_id]}

    def release(self, session_id: str) -> tuple[str, dict[str, str]] | None:
        if not self.release_path:
            return None
        return self.release_path, {"session_id": session_id}

    def served_names(self, body: bytes) -> list[str]:
        return openai_model_ids(body)

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
        """Read `routed_experts`, `sampling_mask` and `weight_versions` from the choice.

        vLLM 0.33 sends `weight_versions` on every choice (token_in_token_out/protocol.py
        GenerateChoiceBase): contiguous spans over the output tokens, from the weight
        version each engine step ran under (v1/engine/output_processor.py).
        """
        try:
            output.weight_versions = read_spans(
                choice.get("weight_versions"), len(output.completion_ids)
            )
        except SpansError as exc:
            raise EngineError(str(exc)) from exc
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


def _stopped_spans(value: Any, count: int) -> list[Span] | None:
    """An aborted stream's spans over the tokens it delivered: an abort may land after the
    engine sampled tokens it never streamed, so longer spans are clipped; spans that do
    not reach the delivered tokens say nothing usable (None)."""
    try:
        spans = clip_spans(read_spans(value, None), count)
    except SpansError:
        return None
    return spans if spans and spans[-1]["end"] == count else None


def openai_model_ids(body: bytes) -> list[str]:
    """The `data[].id` values of an OpenAI model list (vLLM's `/v1/models`), in order."""
    try:
        listing = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


class EngineStream:
    """vLLM's streamed reply (StreamReader): feed each decoded `data:` chunk; `finish()`
    gives the EngineOutput or raises EngineError.

    vLLM's streamed generate route (token_in_token_out/serving.py
    `serve_tokens_stream_generator`, 0.26 and 0.33) sends one `data:` JSON chunk per engine
    step: `choices[0]` carries that step's `token_ids`, their `logprobs.content` entries and
    `sampling_mask` rows (v1/engine/output_processor.py clears the mask chunks per delta);
    the chunk with a `finish_reason` carries the whole `routed_experts` array (concatenated
    on finish) and the `weight_versions` spans over the whole output. A usage chunk
    (`choices: []`) and `data: [DONE]` end it; a failure inside
    the stream arrives as a `data:` object with an `error`. Everything is kept in the order
    the engine sent it, and the finished reply is validated by `VLLMEngine.parse`, so a
    streamed and a non-streamed reply are read by one set of rules.
    """

    def __init__(self, engine: VLLMEngine, routes_from: int) -> None:
        self.engine = engine
        self.routes_from = routes_from
        self.token_ids: list[int] = []
        self._logprobs: list[Any] = []
        self._mask: list[Any] | None = None
        self._experts: list[Any] = []
        self._versions: Any = None
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
        if choice.get("weight_versions") is not None:  # the finishing chunk's, over all tokens
            self._versions = choice["weight_versions"]
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
            "weight_versions": _stopped_spans(self._versions, len(self.token_ids))
            if stopped
            else self._versions,
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

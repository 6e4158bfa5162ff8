"""A scripted vLLM engine on a real socket (`POST /inference/v1/generate`, `GET /v1/models`).

Used by tests, `skycap demo` (deterministic, no network) and benchmarks, so it needs no
pytest. Replies come from a queue of scripted texts, then from a script function (by
default a short deterministic tool-calling episode derived from the prompt). Each text is
encoded with the given tokenizer plus the stop token, and answered in vLLM's reply shape
(`version="0.33"`, the default, or `"0.26"`) with deterministic logprobs, routed experts
and sampling masks, so tests can check exactly what was captured. Faults can be injected
per call.

It refuses what vLLM 0.33 refuses, each rule naming the vLLM source it mirrors (paths under
`vllm/`): an unknown `model` (404), a bad `cache_salt`, sampling values out of range, stop
strings on a `--tokens-only` server, and, when started "with --return-sampling-mask"
(`sampling_mask=True`), requests without temperature > 0 and top_k > 0. 0.26 has no
cache-salt rule and no sampling masks.

    engine = ScriptedEngine(tokenizer)
    url = engine.start()
    engine.queue("<think>\\nok\\n</think>\\n\\nHello.")
    engine.fail_next("http_500")
    ...
    engine.stop()
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from skycap.mock.vllm_rules import cache_salt_problem, sampling_problem, stream_problem

GENERATE_PATH = "/inference/v1/generate"

#: Fault modes accepted by `ScriptedEngine.fail_next`.
FAULTS = frozenset(
    {
        "no_choices",  # 200 with "choices": []
        "empty_token_ids",  # 200 with an empty completion
        "no_logprobs",  # 200 with "logprobs": null
        "short_logprobs",  # 200 with one logprob fewer than completion tokens
        "experts_rank",  # 200 with 2-D routed experts
        "experts_coverage",  # 200 with two routed-expert rows missing
        "not_json",  # 200 whose body is not JSON
        "http_500",  # 500 with a JSON error body
        "http_400",  # 400 with a JSON error body
        "hang",  # no answer until release() (then a normal answer) or stop() (then a close)
        "close",  # the connection is closed without an answer
        "missing_logprobs",  # 200 with vLLM's -9999.0 "no logprob" for the first token
        "stream_break",  # a streamed reply whose connection closes after half its chunks
        "stream_no_finish",  # a streamed reply that ends ([DONE]) without a finish reason
    }
)
ABORT_PATH = "/inference/v1/abort_requests"
VERSIONS = ("0.33", "0.26")
EXPERT_DTYPES = ("uint8", "uint16", "int32")

#: vLLM's "no logprob" value (token_in_token_out/serving.py `_clamp_logprob`).
MISSING_LOGPROB = -9999.0
#: Distinct expert ids the scripted router picks from.
NUM_EXPERTS = 64


@dataclass(frozen=True)
class Reply:
    """A scripted completion.

    "stop": the text's tokens plus the stop token. "length": the text's tokens only (a
    reply cut off, e.g. inside a thinking block). "repetition" (vLLM's repetitive-pattern
    stop) and "abort" (a request aborted inside the engine) also end without a stop token.
    Every kind is cut at the request's `max_tokens`, which makes the finish reason "length".
    """

    text: str
    finish_reason: str = "stop"


@dataclass(frozen=True)
class Request:
    """One request the engine received, as decoded JSON (None if the body was not JSON)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any


Script = Callable[[dict[str, Any]], Reply | str]


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
    """Base64 of a `.npy` file, the engine's routed-experts encoding (http.md §10.2)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class ScriptedEngine:
    """A deterministic vLLM generate endpoint on 127.0.0.1, served from its own thread."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        replies: Iterable[Reply | str] = (),
        script: Script | None = None,
        stop_token: str = "<|im_end|>",
        experts: tuple[int, int] | None = (4, 2),
        sampling_mask: bool = False,
        model: str | Sequence[str] = "scripted-policy",
        version: str = "0.33",
        tokens_only: bool = True,
        scale_out: bool = True,
        experts_dtype: str = "uint8",
    ) -> None:
        """`tokenizer` is a transformers tokenizer or a path/name to load one from.

        `experts` is (layers, k) for routed experts, or None to answer `null`. `model` is
        the served name, or several (`--served-model-name a b`). `sampling_mask` is a server
        started with `--return-sampling-mask` (0.33 only); `tokens_only` one started with
        `--tokens-only` (no tokenizer, so stop strings are refused); `scale_out=False` a 0.33
        server without `--enable-scale-out` or `--tokens-only`, which answers 403.
        `experts_dtype` is the routed-experts dtype on the wire.
        """
        if version not in VERSIONS:
            raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
        if sampling_mask and version != "0.33":
            raise ValueError("vLLM 0.26 has no sampling masks (--return-sampling-mask is 0.33+)")
        if experts_dtype not in EXPERT_DTYPES:
            raise ValueError(f"experts_dtype must be one of {EXPERT_DTYPES}, got {experts_dtype!r}")
        self._tokenizer = _as_tokenizer(tokenizer)
        self._encode_lock = threading.Lock()
        self.stop_token_id = _single_token_id(self._tokenizer, stop_token)
        if self.stop_token_id is None:
            raise ValueError(f"stop token {stop_token!r} is not a single token of this tokenizer")
        self._tool_response_id = _single_token_id(self._tokenizer, "<tool_response>")
        self._replies: deque[Reply | str] = deque(replies)
        self._script: Script = script or self.default_reply
        self.experts = experts
        self.sampling_mask = sampling_mask
        self.models = [model] if isinstance(model, str) else list(model)
        self.model = self.models[0]
        self.version = version
        self.tokens_only = tokens_only
        self.scale_out = scale_out
        self.experts_dtype = experts_dtype
        #: Streamed replies (`stream: true`): tokens per chunk, seconds between chunks and
        #: before the first one (a long prefill or a queued request).
        self.stream_chunk = 2
        self.stream_pause = 0.0
        self.first_token_delay = 0.0
        #: Request ids aborted through `/inference/v1/abort_requests`.
        self.aborted: list[str] = []
        #: Streamed replies sent to their end.
        self.streams_finished = 0
        self._gate: tuple[int, threading.Event] | None = None
        self.requests: list[Request] = []
        self._faults: list[list[Any]] = []
        self._hangs: list[threading.Event] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> str:
        """Listen on 127.0.0.1 (a free port) and return the engine root URL."""
        if self._server is not None:
            raise RuntimeError(f"scripted engine already running at {self.url}")
        self._stopping = False
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.engine = self
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.02},  # stop() waits up to one interval
            name="scripted-engine",
            daemon=True,
        )
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self.url

    def stop(self) -> None:
        """Stop serving: hung calls and open connections are closed without an answer."""
        if self._server is None:
            return
        with self._cond:
            self._stopping = True
            self._wake_hangs()
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> ScriptedEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scripting ---------------------------------------------------------------------

    def queue(self, *replies: Reply | str) -> None:
        """Answer the next generate calls with these replies, before the script function."""
        with self._cond:
            self._replies.extend(replies)

    def fail_next(self, fault: str, times: int | None = 1) -> None:
        """Make the next `times` generate calls (None: every call until clear_faults) fail."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; use one of {sorted(FAULTS)}")
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 or None, got {times!r}")
        with self._cond:
            self._faults.append([fault, times])

    def clear_faults(self) -> None:
        with self._cond:
            self._faults.clear()

    def release(self) -> None:
        """Let every hung call answer normally."""
        with self._cond:
            self._wake_hangs()

    def hold_stream(self, before_chunk: int) -> None:
        """Make streamed replies wait before chunk `before_chunk` until `resume_stream()`."""
        with self._cond:
            self._gate = (before_chunk, threading.Event())

    def resume_stream(self) -> None:
        with self._cond:
            if self._gate is not None:
                self._gate[1].set()
            self._gate = None

    def wait_for_abort(self, timeout: float = 5.0) -> str:
        """Block until a request was aborted; its id (TimeoutError otherwise)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.aborted, timeout):
                raise TimeoutError(f"no abort_requests call within {timeout} s")
            return self.aborted[-1]

    @property
    def generated(self) -> list[Request]:
        """The generate calls received (`requests` also holds `/v1/models` and others)."""
        with self._cond:
            return [r for r in self.requests if r.path.split("?", 1)[0] == GENERATE_PATH]

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> None:
        """Block until `count` generate calls have arrived; TimeoutError otherwise.

        Only generate calls count: a token-mode server also asks `/v1/models` for the
        served name, at start or on its first call.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.generated) >= count, timeout):
                raise TimeoutError(
                    f"scripted engine got {len(self.generated)} generate requests, expected "
                    f"{count} within {timeout} s"
                )

    def default_reply(self, body: dict[str, Any]) -> Reply:
        """A deterministic episode: call the first offered tool twice, then answer.

        Depends only on the prompt: its length, the tools block and how many tool results
        it already holds.
        """
        prompt = body["token_ids"]
        head = self._decode(prompt[:4096])
        tool = re.search(r'<tools>.*?"name":\s*"([^"]+)"', head, re.DOTALL)
        if self._tool_response_id is not None:
            results = prompt.count(self._tool_response_id)
        else:
            results = self._decode(prompt).count("<tool_response>")
        if tool and results < 2:
            name = tool.group(1)
            args = json.dumps({"query": f"step {results + 1}"})
            return Reply(
                f"<think>\nStep {results + 1}: I will call {name}.\n</think>\n\n"
                f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
            )
        return Reply(
            f"<think>\nThe prompt has {len(prompt)} tokens.\n</think>\n\n"
            f"Done: read {results} tool results in a {len(prompt)}-token prompt."
        )

    # -- serving -----------------------------------------------------------------------

    def _wake_hangs(self) -> None:
        for event in self._hangs:
            event.set()
        self._hangs.clear()

    def _take_fault(self) -> str | None:
        with self._cond:
            if not self._faults:
                return None
            entry = self._faults[0]
            if entry[1] is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    self._faults.pop(0)
            return entry[0]

    def _record(self, request: Request) -> None:
        with self._cond:
            self.requests.append(request)
            self._cond.notify_all()

    def _hang(self) -> bool:
        """Wait until released (True) or stopped (False)."""
        event = threading.Event()
        with self._cond:
            if self._stopping:
                return False
            self._hangs.append(event)
        event.wait()
        return not self._stopping

    def _generate(self, body: Any) -> tuple[int, bytes] | None:
        """(status, JSON bytes) for a generate call, or None to close the connection."""
        fault = self._take_fault()
        if fault == "close" or (fault == "hang" and not self._hang()):
            return None
        if fault == "not_json":
            return 200, b"<html>this is not JSON</html>"
        if fault in ("http_500", "http_400"):
            status = int(fault[-3:])
            return status, _json({"error": {"message": f"scripted engine fault {fault}"}})
        if self.version == "0.33" and not self.scale_out:
            # entrypoints/scale_out/factories.py `register_scale_out_api_routers`
            return 403, _error(
                "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out "
                "to enable them.",
                "PermissionDeniedError",
                403,
            )
        problem = _bad_request(body)
        if problem:
            return 400, _error(problem)
        model = body.get("model")
        if model and model not in self.models:
            # entrypoints/serve/engine/serving.py `_check_model`
            return 404, _error(
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.models)}.",
                "NotFoundError",
                404,
                "model",
            )
        problem = self._refusal(body)
        if problem:
            return 400, _error(problem)
        with self._cond:
            reply = self._replies.popleft() if self._replies else None
        reply = reply if reply is not None else self._script(body)
        answer = self._answer(body, reply, fault)
        if body.get("stream") is True:
            return 200, StreamedReply(self._stream_chunks(body, answer), fault)
        return 200, _json(answer)

    def _stream_chunks(self, body: dict[str, Any], answer: dict[str, Any]) -> list[dict[str, Any]]:
        """The reply as 0.33's stream sends it (token_in_token_out/serving.py
        `serve_tokens_stream_generator`, chunk shape protocol.py GenerateTokensStreamResponse):
        one chunk per engine step with its token ids, logprob entries and mask rows; the
        last carries the finish reason, stop reason and the whole routed-experts array
        (v1/engine/output_processor.py concatenates them on finish); a usage chunk only
        with `stream_options.include_usage`."""
        request_id = f"generate-tokens-{body.get('request_id') or answer['request_id']}"
        if not answer["choices"]:
            return [{"request_id": request_id, "choices": []}]
        choice = answer["choices"][0]
        ids, entries = choice["token_ids"], (choice["logprobs"] or {}).get("content")
        mask = choice.get("sampling_mask")
        step = max(self.stream_chunk, 1)
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

    def _abort(self, body: Any) -> tuple[int, bytes]:
        """token_in_token_out/api_router.py `abort_requests` (0.33): 200, or 400 without ids."""
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is None:
            return 400, _json({"detail": "Missing 'request_ids' in request body"})
        with self._cond:
            self.aborted.extend(ids if isinstance(ids, list) else [ids])
            self._cond.notify_all()
        return 200, b""

    def _stream_wait(self, index: int) -> None:
        """Pause before chunk `index`: the first token's delay, the pause, or a held gate."""
        with self._cond:
            gate = self._gate
        if gate is not None and gate[0] == index:
            gate[1].wait()
        delay = self.first_token_delay if index == 0 else self.stream_pause
        if delay:
            time.sleep(delay)  # the engine is generating

    def _answer(
        self, body: dict[str, Any], reply: Reply | str, fault: str | None
    ) -> dict[str, Any]:
        if isinstance(reply, str):
            reply = Reply(reply)
        prompt: list[int] = body["token_ids"]
        params = body.get("sampling_params") or {}
        ids, finish = self._completion(reply, params.get("max_tokens"))
        if fault == "empty_token_ids":
            ids = []
        values = [scripted_logprob(t, len(prompt) + i) for i, t in enumerate(ids)]
        if fault == "missing_logprobs" and values:
            values[0] = MISSING_LOGPROB
        logprobs = [self._logprob_entry(t, v) for t, v in zip(ids, values, strict=True)]
        if fault == "short_logprobs":
            logprobs = logprobs[:-1]
        choice = {
            "index": 0,
            "token_ids": ids,
            "logprobs": None if fault == "no_logprobs" else {"content": logprobs},
            "finish_reason": finish,
            "routed_experts": self._experts(prompt + ids, params, fault),
        }
        if self.version == "0.33":
            # token_in_token_out/protocol.py GenerateChoiceBase (0.26 has no masks)
            choice["stop_reason"] = self.stop_token_id if finish == "stop" else None
            choice["sampling_mask"] = [[t, t + 1] for t in ids] if self.sampling_mask else None
        with self._cond:
            number = len(self.requests)
        return {
            "request_id": f"gen-{number}",
            "model": self.model,
            "created": int(time.time()),
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
            "choices": [] if fault == "no_choices" else [choice],
        }

    def _logprob_entry(self, token: int, value: float) -> dict[str, Any]:
        """One sampled-token entry in this version's shape (logprobs=0: no alternatives)."""
        if self.version == "0.26":
            # 0.26 token_in_token_out/serving.py `_create_tokens_logprobs`
            entry = {"token": f"token_id:{token}", "logprob": value, "bytes": None}
            return {**entry, "top_logprobs": [entry]}
        # 0.33 token_in_token_out/serving.py `_create_tokens_logprobs`
        entry = {"token_id": token, "logprob": value, "rank": 1}
        return {**entry, "top_logprobs": [entry]}

    def _refusal(self, body: dict[str, Any]) -> str | None:
        """What this vLLM version refuses in a well-formed request, or None."""
        if self.version == "0.33":
            problem = cache_salt_problem(body.get("cache_salt"))
            if problem:
                return problem
        elif "cache_salt" in body and not isinstance(body["cache_salt"], str | None):
            return "cache_salt: Input should be a valid string"  # pydantic field type (0.26)
        params = body.get("sampling_params", {})
        problem = sampling_problem(params)
        if problem:
            return problem
        if body.get("stream") is True and self.version == "0.33":
            problem = stream_problem(params)
            if problem:
                return problem
        if params.get("stop") and self.tokens_only:
            # token_in_token_out/serving.py `serve_tokens` (0.33)
            return (
                "stop strings are not supported on a --tokens-only server because "
                "detokenization is disabled. Check stop strings on the coordinator, or use "
                "stop_token_ids."
            )
        if params.get("stop"):
            return "the scripted engine does not apply stop strings (start it tokens_only)"
        if self.sampling_mask:
            # v1/engine/input_processor.py, under model_config.return_sampling_mask
            temperature, top_k = params.get("temperature", 1.0), params.get("top_k", 0)
            if temperature <= 0:
                return "sampling distribution replay requires temperature > 0"
            if top_k <= 0:
                return (
                    "sampling distribution replay requires top_k > 0 to bound sampling mask "
                    "size, reduce transfer overhead, and avoid potential OOMs"
                )
        return None

    def _completion(self, reply: Reply, max_tokens: Any) -> tuple[list[int], str]:
        ids = self._encode(reply.text)
        if reply.finish_reason == "stop":
            ids.append(self.stop_token_id)
        if isinstance(max_tokens, int) and 0 <= max_tokens < len(ids):
            return ids[:max_tokens], "length"
        return ids, reply.finish_reason

    def _experts(
        self, sequence: list[int], params: dict[str, Any], fault: str | None
    ) -> str | None:
        if self.experts is None:
            return None
        layers, k = self.experts
        start = params.get("routed_experts_prompt_start") or 0
        rows = scripted_experts(sequence, start, layers, k)
        if fault == "experts_rank":
            rows = rows[:, :, 0]
        elif fault == "experts_coverage":
            rows = rows[:-2]
        return npy_base64(rows.astype(self.experts_dtype))

    def _encode(self, text: str) -> list[int]:
        with self._encode_lock:
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: Sequence[int]) -> str:
        with self._encode_lock:
            return self._tokenizer.decode(list(ids), skip_special_tokens=False)


@dataclass
class StreamedReply:
    """A streamed generate answer: its chunks, and the stream fault to play, if any."""

    chunks: list[dict[str, Any]]
    fault: str | None


def _bad_request(body: Any) -> str | None:
    """What vLLM would reject with a 400, or None."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    ids = body.get("token_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        return "token_ids must be a non-empty list of non-negative integers"
    params = body.get("sampling_params", {})
    if not isinstance(params, dict):
        return "sampling_params must be an object"
    start = params.get("routed_experts_prompt_start", 0)
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < len(ids):
        return f"routed_experts_prompt_start must be in [0, {len(ids)}), got {start!r}"
    return None


def _error(
    message: str, kind: str = "BadRequestError", code: int = 400, param: str | None = None
) -> bytes:
    """vLLM's ErrorResponse body (entrypoints/serve/engine/protocol.py)."""
    return _json({"error": {"message": message, "type": kind, "param": param, "code": code}})


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def _as_tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, str | os.PathLike):
        from skycap.tokens.renderer import quiet_transformers_import

        quiet_transformers_import()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    return tokenizer


class _Server(ThreadingHTTPServer):
    """Tracks open connections so stop() can close keep-alive clients too."""

    daemon_threads = True
    engine: ScriptedEngine

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()

    def close_connections(self) -> None:
        with self.connections_lock:
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.connections.clear()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets its keep-alive connection has simply left: no traceback."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body leave in one segment, without Nagle: no 40 ms delayed-ACK stalls.
    wbufsize = 1 << 16
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.connections_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.connections_lock:
            self.server.connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests and the demo read `engine.requests` instead."""

    def do_GET(self) -> None:
        engine = self.server.engine
        engine._record(Request("GET", self.path, dict(self.headers.items()), None))
        if self._route() != "/v1/models":
            self._no_route()
            return
        models = [{"id": m, "object": "model", "owned_by": "vllm"} for m in engine.models]
        self._send(200, _json({"object": "list", "data": models}))

    def do_POST(self) -> None:
        engine = self.server.engine
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        engine._record(Request("POST", self.path, dict(self.headers.items()), body))
        route = self._route()
        if route == ABORT_PATH:
            self._send(*engine._abort(body))
            return
        if route != GENERATE_PATH:
            self._no_route()
            return
        answer = engine._generate(body)
        if answer is None:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by stop()
            return
        if isinstance(answer[1], StreamedReply):
            self._stream(answer[1])
            return
        self._send(*answer)

    def _stream(self, reply: StreamedReply) -> None:
        """Send the chunks as SSE, paced as the engine generates; stop after an abort."""
        engine = self.server.engine
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunks = reply.chunks
        request_id = chunks[0]["request_id"]
        try:
            for index, chunk in enumerate(chunks):
                if reply.fault == "stream_break" and index >= max(len(chunks) // 2, 1):
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                engine._stream_wait(index)
                with engine._cond:
                    aborted = request_id in engine.aborted
                if aborted:  # v1 engine: an aborted request finishes with "abort"
                    end = {**chunk["choices"][0], "token_ids": [], "finish_reason": "abort"}
                    end["logprobs"] = {"content": []}
                    chunk = {**chunk, "choices": [end]}
                elif reply.fault == "stream_no_finish" and chunk["choices"]:
                    chunk["choices"][0]["finish_reason"] = None
                self._chunk(b"data: " + _json(chunk) + b"\n\n")
                if aborted:
                    break
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
            with engine._cond:
                engine.streams_finished += 1
                engine._cond.notify_all()
        except OSError:
            self.close_connection = True  # the client went away: vLLM aborts the request

    def _route(self) -> str:
        return self.path.split("?", 1)[0]

    def _no_route(self) -> None:
        self._send(404, _json({"error": {"message": f"no route {self.path}"}}))

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _send(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

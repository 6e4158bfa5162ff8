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

Like 0.33 it reports which weight version sampled which output tokens (`weight_versions`
on each choice, on the finishing chunk when streamed) and serves the RL routes that set
the version (`POST /update_weight_version`, `POST /finish_weight_update`,
`GET /weight_info`) and `GET /version` (skycap.mock.weight_clock names the vLLM source of
each rule). `engine.weights.switch_at(5, "4")` switches the next completion to version
"4" from its output token 5, streamed or not; a version set through the routes while a
stream is held (`hold_stream`) labels the rest of that stream.

    engine = ScriptedEngine(tokenizer)
    url = engine.start()
    engine.queue("<think>\\nok\\n</think>\\n\\nHello.")
    engine.fail_next("http_500")
    engine.weights.switch_at(5, "4")
    ...
    engine.stop()
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from skycap.mock.engine_http import (
    GENERATE_PATH,
    EngineHandler,
    EngineServer,
    Request,
    StreamedReply,
)
from skycap.mock.engine_wire import (
    MISSING_LOGPROB,
    error_body,
    json_bytes,
    logprob_entry,
    npy_base64,
    scripted_experts,
    scripted_logprob,
    stream_chunks,
)
from skycap.mock.vllm_rules import (
    cache_salt_problem,
    sampling_mask_problem,
    sampling_problem,
    stream_problem,
    tokens_only_stop_problem,
)
from skycap.mock.weight_clock import WeightClock

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
VERSIONS = ("0.33", "0.26")
EXPERT_DTYPES = ("uint8", "uint16", "int32")


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


Script = Callable[[dict[str, Any]], Reply | str]


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
        #: The weight version the RL routes set, and scripted switches inside a completion.
        self.weights = WeightClock()
        #: What `GET /version` answers (entrypoints/serve/instrumentator/basic.py).
        self.vllm_version = f"{version}.0"
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
        self._held = False
        self.requests: list[Request] = []
        self._faults: list[list[Any]] = []
        self._hangs: list[threading.Event] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._server: EngineServer | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> str:
        """Listen on 127.0.0.1 (a free port) and return the engine root URL."""
        if self._server is not None:
            raise RuntimeError(f"scripted engine already running at {self.url}")
        self._stopping = False
        self._server = EngineServer(("127.0.0.1", 0), EngineHandler)
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
            self._held = False

    def resume_stream(self) -> None:
        with self._cond:
            if self._gate is not None:
                self._gate[1].set()
            self._gate = None
            self._held = False

    def wait_until_held(self, timeout: float = 10.0) -> None:
        """Block until a streamed reply waits at the `hold_stream` gate: every chunk before
        it has been generated (TimeoutError otherwise)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._held, timeout):
                raise TimeoutError(f"no streamed reply reached the held chunk in {timeout} s")

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

    def record(self, request: Request) -> None:
        """Log a request as received (the HTTP handler calls this for every request)."""
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

    def generate(self, body: Any) -> tuple[int, bytes | StreamedReply] | None:
        """(status, JSON bytes or a stream) for a generate call, or None to close the connection."""
        fault = self._take_fault()
        if fault == "close" or (fault == "hang" and not self._hang()):
            return None
        if fault == "not_json":
            return 200, b"<html>this is not JSON</html>"
        if fault in ("http_500", "http_400"):
            status = int(fault[-3:])
            return status, json_bytes({"error": {"message": f"scripted engine fault {fault}"}})
        if self.version == "0.33" and not self.scale_out:
            # entrypoints/scale_out/factories.py `register_scale_out_api_routers`
            return 403, error_body(
                "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out "
                "to enable them.",
                "PermissionDeniedError",
                403,
            )
        problem = _bad_request(body)
        if problem:
            return 400, error_body(problem)
        model = body.get("model")
        if model and model not in self.models:
            # entrypoints/serve/engine/serving.py `_check_model`
            return 404, error_body(
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.models)}.",
                "NotFoundError",
                404,
                "model",
            )
        problem = self._refusal(body)
        if problem:
            return 400, error_body(problem)
        with self._cond:
            reply = self._replies.popleft() if self._replies else None
        reply = reply if reply is not None else self._script(body)
        answer = self._answer(body, reply, fault)
        spans = self.weights.request() if self.version == "0.33" else None
        if body.get("stream") is True:
            chunks = stream_chunks(body, answer, self.stream_chunk)
            return 200, StreamedReply(chunks, fault, spans)
        if spans is not None and answer["choices"]:
            # token_in_token_out/serving.py `serve_tokens`: the finished output's spans
            choice = answer["choices"][0]
            spans.label(len(choice["token_ids"]))
            choice["weight_versions"] = spans.spans()
        return 200, json_bytes(answer)

    def weight_route(self, method: str, route: str, body: Any) -> tuple[int, bytes] | None:
        """vLLM's RL and version routes (entrypoints/rl/online/api_router.py,
        entrypoints/serve/instrumentator/basic.py); None for another route."""
        if method == "GET" and route == "/version":
            return 200, json_bytes({"version": self.vllm_version})
        if method == "GET" and route == "/weight_info":
            return 200, json_bytes({"weight_version": self.weights.version})
        if method == "POST" and route == "/update_weight_version":
            version = body.get("new_version") if isinstance(body, dict) else None
            if not isinstance(version, str):  # FastAPI's embedded required str body field
                return 422, json_bytes({"detail": "new_version: Field required (a string)"})
            self.weights.set(version)
            return 200, json_bytes({"success": True, "new_version": version})
        if method == "POST" and route == "/finish_weight_update":
            version = body.get("weight_version") if isinstance(body, dict) else None
            if version is not None and not isinstance(version, str):
                return 422, json_bytes({"detail": "weight_version: Input should be a string"})
            if version is not None:  # v1/engine/async_llm.py `finish_weight_update`
                self.weights.set(version)
            return 200, json_bytes({"message": "Weight update finished"})
        return None

    def abort(self, body: Any) -> tuple[int, bytes]:
        """token_in_token_out/api_router.py `abort_requests` (0.33): 200, or 400 without ids."""
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is None:
            return 400, json_bytes({"detail": "Missing 'request_ids' in request body"})
        with self._cond:
            self.aborted.extend(ids if isinstance(ids, list) else [ids])
            self._cond.notify_all()
        return 200, b""

    def stream_wait(self, index: int) -> None:
        """Pause before chunk `index`: the first token's delay, the pause, or a held gate."""
        with self._cond:
            gate = self._gate
        if gate is not None and gate[0] == index:
            with self._cond:
                self._held = True
                self._cond.notify_all()
            gate[1].wait()
        delay = self.first_token_delay if index == 0 else self.stream_pause
        if delay:
            time.sleep(delay)  # the engine is generating

    def is_aborted(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self.aborted

    def note_stream_finished(self) -> None:
        with self._cond:
            self.streams_finished += 1
            self._cond.notify_all()

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
        logprobs = [logprob_entry(self.version, t, v) for t, v in zip(ids, values, strict=True)]
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
            return tokens_only_stop_problem()
        if params.get("stop"):
            return "the scripted engine does not apply stop strings (start it tokens_only)"
        if self.sampling_mask:
            return sampling_mask_problem(params)
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


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def _as_tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, str | os.PathLike):
        from skycap.tokens.tokenizer_env import quiet_transformers_import

        quiet_transformers_import()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    return tokenizer

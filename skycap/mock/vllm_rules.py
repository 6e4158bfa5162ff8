"""The request rules of vLLM 0.33's generate route that the scripted engine enforces.

Each names the vLLM source (under `vllm/`) it mirrors, written from that source rather than
from skycap's own checks (skycap.tokens.sampling), so a mistake in one shows in the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: SamplingParams field defaults the checks read (sampling_params.py).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "max_tokens": 16,
    "min_tokens": 0,
}


def cache_salt_problem(salt: Any) -> str | None:
    """entrypoints/generate/base/protocol.py `validate_cache_salt` (0.33)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        return "Parameter 'cache_salt' must be a non-empty string if provided."
    if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
        return (
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL."
        )
    return None


#: sampling_params.py `SamplingParams._verify_args`: (field, accepts, vLLM's message).
_SAMPLING_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("presence_penalty", lambda v: -2.0 <= v <= 2.0, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", lambda v: v > 0.0, "repetition_penalty must be greater than zero"),
    ("temperature", lambda v: 0.0 <= v <= 2.0, "temperature must be in [0, 2]"),
    ("top_p", lambda v: 0.0 < v <= 1.0, "top_p must be in (0, 1]"),
    ("top_k", lambda v: v >= -1, "top_k must be 0 (disable), or at least 1"),
    ("min_p", lambda v: 0.0 <= v <= 1.0, "min_p must be in [0, 1]"),
    ("max_tokens", lambda v: v >= 1, "max_tokens must be at least 1"),
    ("min_tokens", lambda v: v >= 0, "min_tokens must be greater than or equal to 0"),
)


def sampling_problem(params: dict[str, Any]) -> str | None:
    """sampling_params.py `SamplingParams._verify_args`, over vLLM's field defaults."""
    merged = {**SAMPLING_DEFAULTS, **params}
    for key, accepts, message in _SAMPLING_RULES:
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"sampling_params.{key}: Input should be a valid number"  # pydantic
        if not accepts(value):
            return f"{message}, got {value}."
    if merged["min_tokens"] > merged["max_tokens"]:
        return (
            f"min_tokens must be less than or equal to max_tokens={merged['max_tokens']}, "
            f"got {merged['min_tokens']}."
        )
    return None


# How 0.33 streams the generate route, which the scripted engine's streamed replies follow
# (skycap.mock.engine_wire `stream_chunks`; entrypoints/scale_out/token_in_token_out/serving.py
# `serve_tokens_stream_generator`,
# v1/engine/output_processor.py for what each delta carries):
# - one `data:` chunk per engine step with only that step's `token_ids`, their
#   `logprobs.content` entries and `sampling_mask` rows (mask chunks are cleared per delta);
# - `finish_reason` and `stop_reason` only on the terminal chunk, which is always sent,
#   even without new tokens (an abort), and the only one with `routed_experts` (the chunks
#   are concatenated on finish);
# - a `choices: []` usage chunk only with `stream_options.include_usage`, then
#   `data: [DONE]`; an aborted request (api_router.py `abort_requests`) ends `abort`.


def stream_problem(params: dict[str, Any]) -> str | None:
    """token_in_token_out/serving.py `serve_tokens` (0.33): what a streamed request cannot ask."""
    if params.get("prompt_logprob_token_ids") is not None:
        return "prompt_logprob_token_ids are not available when stream=true."
    return None


def tokens_only_stop_problem() -> str:
    """token_in_token_out/serving.py `serve_tokens` (0.33): stop strings on a --tokens-only
    server, which has no tokenizer to detokenize with."""
    return (
        "stop strings are not supported on a --tokens-only server because "
        "detokenization is disabled. Check stop strings on the coordinator, or use "
        "stop_token_ids."
    )


def sampling_mask_problem(params: dict[str, Any]) -> str | None:
    """v1/engine/input_processor.py, under model_config.return_sampling_mask (a server
    started with --return-sampling-mask): the sampling it can replay."""
    temperature, top_k = params.get("temperature", 1.0), params.get("top_k", 0)
    if temperature <= 0:
        return "sampling distribution replay requires temperature > 0"
    if top_k <= 0:
        return (
            "sampling distribution replay requires top_k > 0 to bound sampling mask "
            "size, reduce transfer overhead, and avoid potential OOMs"
        )
    return None

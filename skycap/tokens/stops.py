"""Stop strings applied by skycap to a finished completion, the way vLLM's detokenizer does.

Any dialect calls `apply_stop` (or `find_stop` and `cut_completion`) with its list of stop
strings (Chat Completions `stop`, Anthropic `stop_sequences`, Responses ...), then
`strip_stop` on the parsed reply. skycap never forwards stop strings to the engine (a
`--tokens-only` vLLM refuses them); it samples the whole completion and cuts it here.
The rule is vLLM's (v1/engine/detokenizer.py `IncrementalDetokenizer.update` and
`check_stop_strings`): the decoded text is checked after `min_tokens` tokens; the stop string
that completes earliest wins (ties by list order); the tokens are kept through the one that
completes it, and the text ends just before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from skycap.tokens.engine import EngineOutput
from skycap.tokens.renderer import RAW_CONTENT_CONTEXT, Renderer, decode_spans_as
from skycap.weights import clip_spans


@dataclass(frozen=True, slots=True)
class StopMatch:
    """Where a stop string cut the completion."""

    stop: str
    #: Completion tokens kept: through the token that completes the stop string.
    keep: int
    #: The decoded completion text before the stop string (what vLLM answers as text).
    text: str
    #: The decoded text of the kept tokens from the stop string on (the stop string plus any
    #: characters the completing token carries after it).
    tail: str


def decode_with_offsets(
    renderer: Renderer,
    token_ids: Sequence[int],
    context: Sequence[int],
    *,
    skip_special_tokens: bool,
) -> tuple[str, list[int]]:
    """(text, the character offset where each token's text starts) for a stream decode."""
    data, offsets = decode_spans_as(
        renderer, token_ids, context, skip_special_tokens=skip_special_tokens
    )
    # Byte offsets to character offsets: each token's text starts at a character boundary.
    chars, count, previous = [], 0, 0
    for offset in offsets:
        count += len(data[previous:offset].decode("utf-8", "replace"))
        chars.append(count)
        previous = offset
    return data.decode("utf-8", "replace"), chars


def find_stop(
    renderer: Renderer,
    completion_ids: Sequence[int],
    stops: Sequence[str],
    prompt_ids: Sequence[int] = (),
    *,
    min_tokens: int = 0,
    skip_special_tokens: bool = True,
) -> StopMatch | None:
    """The first stop string in the completion's text, or None.

    A trailing stop token (the renderer's `stop_token_ids`) is not decoded, as vLLM leaves
    the token that stopped generation out of the text.
    """
    if not stops or not completion_ids:
        return None
    end = len(completion_ids)
    if completion_ids[-1] in set(renderer.stop_token_ids):
        end -= 1
    context = list(prompt_ids[-RAW_CONTENT_CONTEXT:])
    text, starts = decode_with_offsets(
        renderer, completion_ids[:end], context, skip_special_tokens=skip_special_tokens
    )
    bounds = [*starts[1:], len(text)]  # where each token's text ends
    # vLLM checks once more than min_tokens tokens exist, for stops ending in the new text:
    # a stop may begin inside the first min_tokens tokens but must end after them.
    threshold = starts[min_tokens] if min_tokens < len(starts) else len(text) + 1
    best: tuple[int, int, str] | None = None  # (end, index, stop)
    for stop in stops:
        index = (
            text.find(stop, max(threshold - len(stop) + 1, 0)) if min_tokens else text.find(stop)
        )
        if index != -1 and (best is None or index + len(stop) < best[0]):
            best = (index + len(stop), index, stop)
    if best is None:
        return None
    stop_end, index, stop = best
    keep = next(k + 1 for k, bound in enumerate(bounds) if bound >= stop_end)
    return StopMatch(stop=stop, keep=keep, text=text[:index], tail=text[index : bounds[keep - 1]])


def strip_stop(message: dict[str, Any], match: StopMatch) -> dict[str, Any]:
    """The reply message parsed from the kept tokens, without the stop string and after it.

    The stop string ends the answer (content), or the reasoning if it came up while thinking;
    parsers may trim whitespace, so the tail is matched with and without it.
    """
    out = dict(message)
    for key in ("content", "reasoning_content"):
        value = out.get(key)
        if not isinstance(value, str):
            continue
        for tail in (match.tail, match.tail.rstrip()):
            if tail and value.endswith(tail):
                out[key] = value[: len(value) - len(tail)]
                return out
        cut = value.rfind(match.stop)
        if cut != -1:
            out[key] = value[:cut]
            return out
    return out


def cut_completion(output: EngineOutput, keep: int, prompt_tokens: int) -> None:
    """Keep the first `keep` completion tokens, with logprobs, mask, expert rows and weight
    versions to match.

    Expert rows cover positions [start, total - 1) (the last sampled token is never
    forwarded), so they end one position before the last kept token.
    """
    output.completion_ids = output.completion_ids[:keep]
    output.logprobs = output.logprobs[:keep]
    if output.sampling_mask is not None:
        output.sampling_mask = output.sampling_mask[:keep]
    output.weight_versions = clip_spans(output.weight_versions, keep)
    if output.routed_experts is not None:
        rows = max(prompt_tokens + keep - 1 - output.routed_start, 0)
        output.routed_experts = output.routed_experts[:rows]
    output.finish_reason = "stop"


def apply_stop(
    renderer: Renderer,
    output: EngineOutput,
    stops: Sequence[str],
    prompt_ids: Sequence[int],
    *,
    min_tokens: int = 0,
    skip_special_tokens: bool = True,
) -> StopMatch | None:
    """Find the first stop string and cut `output` there in place; the match, or None.

    Runs on a renderer worker thread (it decodes the completion).
    """
    match = find_stop(
        renderer,
        output.completion_ids,
        stops,
        prompt_ids,
        min_tokens=min_tokens,
        skip_special_tokens=skip_special_tokens,
    )
    if match is not None:
        cut_completion(output, match.keep, len(prompt_ids))
    return match

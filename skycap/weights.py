"""Weight-version spans: which policy version sampled which completion tokens (format.md §4).

vLLM labels each output token with the weight version its engine step ran under and reports
contiguous `{"version", "start", "end"}` spans over output-token indexes on the finished
output (v1/engine/output_processor.py `_weight_version_spans`). skycap keeps them as plain
dicts in that shape everywhere: on the call, on a sample and on a training row, each over
its own positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Span = dict[str, Any]


class SpansError(ValueError):
    """Spans that are not contiguous, ordered labelled ranges over a completion."""


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_spans(value: Any, count: int | None) -> list[Span] | None:
    """Check spans as vLLM sends them; None stays None (not reported).

    Each span is an object with a string `version` and integer `start` < `end`; spans are
    in order and contiguous from 0, and (when `count` is given) end at `count`, the
    completion's length. Raises SpansError naming the span at fault.
    """
    if value is None:
        return None
    if not isinstance(value, list):
        raise SpansError(f"weight_versions must be a list of spans, got {value!r:.120}")
    spans: list[Span] = []
    cursor = 0
    for i, span in enumerate(value):
        if not isinstance(span, dict):
            raise SpansError(f"weight_versions[{i}] is not an object: {span!r:.120}")
        version, start, end = span.get("version"), span.get("start"), span.get("end")
        if not isinstance(version, str):
            raise SpansError(f"weight_versions[{i}].version must be a string, got {version!r}")
        if not _is_index(start) or not _is_index(end) or end <= start:
            raise SpansError(
                f"weight_versions[{i}] must have integers 0 <= start < end, got "
                f"start={start!r} end={end!r}"
            )
        if start != cursor:
            raise SpansError(
                f"weight_versions[{i}] starts at {start}, expected {cursor}: spans must be "
                "contiguous and in order"
            )
        spans.append({"version": version, "start": start, "end": end})
        cursor = end
    if count is not None and cursor != count:
        raise SpansError(f"weight_versions cover {cursor} tokens of a {count}-token completion")
    return spans


def clip_spans(spans: Sequence[Span] | None, keep: int) -> list[Span] | None:
    """The spans of positions below `keep` (a completion cut at a stop string, a row cut
    to its length)."""
    if spans is None:
        return None
    return [{**span, "end": min(span["end"], keep)} for span in spans if span["start"] < keep]


def shift_spans(spans: Sequence[Span], offset: int) -> list[Span]:
    """The same spans `offset` positions later (completion indexes into a row's positions)."""
    return [
        {"version": s["version"], "start": s["start"] + offset, "end": s["end"] + offset}
        for s in spans
    ]


def join_spans(spans: Sequence[Span]) -> list[Span]:
    """Ordered spans with touching neighbours of one version merged."""
    out: list[Span] = []
    for span in spans:
        last = out[-1] if out else None
        if last is not None and last["version"] == span["version"] and last["end"] == span["start"]:
            last["end"] = span["end"]
        else:
            out.append(dict(span))
    return out


def versions_of(spans: Sequence[Span] | None) -> list[str]:
    """The distinct versions in order of first appearance."""
    return list(dict.fromkeys(span["version"] for span in spans or ()))


#: Where an OpenAI-compatible server's reply or stream event carries the spans: on the
#: first choice (vLLM's Chat Completions and Completions, chat_completion/protocol.py,
#: only with `return_weight_versions: true`; set on the finishing chunk when streamed), or
#: on the reply object itself, also when a Responses event wraps it in `response` or a
#: Messages event in `message` or `delta`.
_HOLDERS = ("response", "message", "delta")


def reported_spans(obj: dict[str, Any]) -> list[Span] | None:
    """The well-formed spans a text-mode reply body carries, else None (a stream's events
    are read where each dialect's events carry them, `EventStream.note_spans`).

    The completion's length is not known in text mode, so only the shape is checked; a
    malformed value is not recorded (it says nothing reliable).
    """
    value = obj.get("weight_versions")
    if value is None:
        choices = obj.get("choices")
        if type(choices) is list and choices and type(choices[0]) is dict:
            value = choices[0].get("weight_versions")
    if value is None:
        for key in _HOLDERS:
            holder = obj.get(key)
            if type(holder) is dict and (value := holder.get("weight_versions")) is not None:
                break
        else:
            return None
    return well_formed_spans(value)


def well_formed_spans(value: Any) -> list[Span] | None:
    """A reported `weight_versions` value as spans, or None when it is not well-formed."""
    try:
        return read_spans(value, None)
    except SpansError:
        return None

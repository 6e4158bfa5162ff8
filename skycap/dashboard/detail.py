"""The one-trajectory screen of `skycap top`: its facts, meta, annotations and newest calls."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from skycap.dashboard.layout import Column, clip, count, duration, fit, header_line, row_line
from skycap.dashboard.view import View

#: The newest calls (and failures) the detail view lists.
DETAIL_CALLS = 50


def detail_lines(view: View, width: int, now: float) -> list[Text]:
    """The detail screen of `view.detail`, with its document's calls once it is read."""
    entry = view.detail
    assert entry is not None
    row = entry.row
    lines = [
        Text(clip(f"trajectory {entry.id} on {entry.server.url}", width), style="bold"),
    ]
    status = str(row.get("status", "?"))
    facts = [
        f"status {status}",
        f"age {duration(row.get('age_s'))}",
        f"idle {duration(row.get('idle_s'))}" if "idle_s" in row else None,
        f"calls {count(row.get('calls'))}",
        f"nodes {count(row.get('nodes'))}",
        f"paths {count(row.get('paths'))}",
        f"unbridged {count(row.get('unbridged_calls'))}",
        f"failures {count(row.get('failures'))}",
    ]
    lines += wrapped([f for f in facts if f], width)
    lines += wrapped(["meta", *(f"{k}={v}" for k, v in entry.meta.items())], width)
    document = view.document
    if isinstance(document, dict) and document.get("annotations"):
        annotations = document["annotations"].items()
        lines += wrapped(["annotations", *(f"{k}={v}" for k, v in annotations)], width)
    if status == "open" and not row.get("ended_at"):
        hint = f"open: end it with POST /trajectories/{entry.id}/finish"
        lines.append(Text(clip(hint, width), style="dim"))
    lines.append(Text(""))
    if document is None:
        lines.append(Text("reading the trajectory...", style="dim"))
        return lines
    if isinstance(document, str):
        lines.append(Text(clip(f"cannot read the trajectory: {document}", width), style="red"))
        return lines
    lines.append(Text("recent calls, newest first", style="bold"))
    events = call_events(document)[:DETAIL_CALLS]
    columns = [
        Column("when", lambda e: duration(now - e["t"]) + " ago", 1, right=True),
        Column("ms", lambda e: e["ms"], 1, right=True),
        Column("in", lambda e: e["prompt"], 2, right=True),
        Column("out", lambda e: e["completion"], 2, right=True),
        Column(
            "finish", lambda e: e["finish"], 1, style=lambda e: "bold red" if e["error"] else ""
        ),
        Column(
            "got back",
            lambda e: e["reply"],
            1,
            flex=True,
            min_width=16,
            style=lambda e: "red" if e["error"] else "",
        ),
    ]
    layout = fit(columns, events, width)
    lines.append(header_line(layout))
    lines.extend(row_line(layout, event) for event in events)
    if not events:
        lines.append(Text("  (no call yet)", style="dim"))
    return lines


def wrapped(parts: list[str], width: int) -> list[Text]:
    """Parts joined by two spaces, broken into lines of `width` (a part longer is cut)."""
    lines: list[str] = []
    for part in parts:
        part = clip(part, width)
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "  " + part
        else:
            lines.append(part)
    return [Text(line) for line in lines]


def call_events(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The document's calls and failures as one list, newest first, with what each got back."""
    events = []
    for node in document.get("nodes") or ():
        for call in node.get("calls") or ():
            usage = call.get("usage") or {}
            t_start, t_end = call.get("t_start") or 0.0, call.get("t_end") or 0.0
            events.append(
                {
                    "t": t_end,
                    "ms": f"{(t_end - t_start) * 1000:,.0f}",
                    "prompt": count(usage.get("prompt_tokens")),
                    "completion": count(usage.get("completion_tokens")),
                    "finish": str(call.get("finish_reason") or "-"),
                    "reply": reply_text(node.get("message") or {}),
                    "error": False,
                }
            )
    for failure in document.get("failures") or ():
        status = failure.get("status")
        events.append(
            {
                "t": failure.get("t") or 0.0,
                "ms": "-",
                "prompt": "-",
                "completion": "-",
                "finish": "error" if status is None else f"error {status}",
                "reply": str(failure.get("error", "")),
                "error": True,
            }
        )
    events.sort(key=lambda e: e["t"], reverse=True)
    return events


def reply_text(message: dict[str, Any]) -> str:
    """A one-line excerpt of a model reply: its text, then its tool calls."""
    parts = []
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    if content:
        parts.append(" ".join(str(content).split()))
    elif message.get("reasoning_content"):
        parts.append("(thinking) " + " ".join(str(message["reasoning_content"]).split()))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        parts.append(f"{function.get('name', '?')}({function.get('arguments', '')})")
    return " | ".join(parts) or "(empty)"

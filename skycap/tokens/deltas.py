"""Reasoning and content deltas from a completion's text as it is decoded, token by token.

The reply a harness is finally answered with is the renderer's parse of the whole
completion (skycap.tokens.reply); what streams before it must be a prefix of that parse,
or the joined stream would differ from the non-streamed reply. So this splitter only
sends what the parse will certainly keep: text inside a thinking block as reasoning, text
after it as content, each without the whitespace at its edges (the parser trims it), and
it holds back whatever could still turn out to be markup (a partial `</think>` or
`<tool_call>`), a stop string being completed, and everything from a tool-call block on
(the block is answered once complete and parsed). `remainder` then gives the rest of
each part from the parse itself.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING, CONTENT = "reasoning", "content"


@dataclass(frozen=True, slots=True)
class Markup:
    """The thinking and tool-call markup of a renderer's template, as decoded text."""

    think_open: str = "<think>"
    think_close: str = "</think>"
    tool_open: str = "<tool_call>"


class DeltaSplitter:
    """Feed decoded text as it arrives; each `feed` returns the (part, text) deltas it frees.

    `markup` None (a template whose markup skycap does not know) streams nothing before
    the end; `raw` (`--use-raw-content`) streams all text as content, as decoded; `thinking`
    means the prompt already opened the thinking block; `hold` is the number of trailing
    characters held back for stop strings (the longest one's length minus one).
    """

    def __init__(self, markup: Markup | None, *, raw: bool, thinking: bool, hold: int) -> None:
        self.markup = markup
        self.raw = raw
        self.hold = hold
        self.text = ""
        self.sent = {REASONING: "", CONTENT: ""}
        self._phase = CONTENT if raw else REASONING if thinking else "start"
        self._start = 0  # where the current part's text starts in `text`
        self._held = markup is None and not raw  # nothing more streams before the end

    @property
    def in_reasoning(self) -> bool:
        return self._phase == REASONING

    def feed(self, piece: str) -> list[tuple[str, str]]:
        """Add decoded text; the deltas it makes safe to send."""
        self.add(piece)
        return self.take()

    def add(self, piece: str) -> None:
        """Add decoded text without sending anything yet (a stop string may end it here)."""
        self.text += piece

    def take(self) -> list[tuple[str, str]]:
        """The deltas the text so far makes safe to send, marked as sent."""
        if self._held:
            return []
        if self._phase == "start" and not self._begin():
            return []
        return self._deltas()

    def close_reasoning(self) -> None:
        """The thinking block ended (its closing token arrived): content follows."""
        if self.markup is None or self._phase != REASONING:
            return
        found = self.text.find(self.markup.think_close, self._start)
        self._start = len(self.text) if found < 0 else found + len(self.markup.think_close)
        self._phase = CONTENT

    def remainder(self, part: str, final: str | None) -> str | None:
        """The rest of `part` (REASONING or CONTENT) once the parse says it is `final`.

        None when what was sent is not a prefix of it (the stream then differs from the
        reply: a parse this splitter did not foresee); the caller logs that.
        """
        final = final or ""
        sent = self.sent[part]
        if not final.startswith(sent):
            return None
        self.sent[part] = final
        return final[len(sent) :]

    def _begin(self) -> bool:
        """Decide whether the completion opens with a thinking block; False: not yet known."""
        assert self.markup is not None
        opening = self.markup.think_open
        head = self.text.lstrip()
        if len(head) < len(opening) and opening.startswith(head):
            return False
        if head.startswith(opening):
            self._phase = REASONING
            self._start = len(self.text) - len(head) + len(opening)
        else:
            self._phase = CONTENT
        return True

    def _deltas(self) -> list[tuple[str, str]]:
        part = self._phase
        body = self.text[self._start :]
        if self.raw:
            visible = body[: max(len(body) - self.hold, 0)]
        else:
            assert self.markup is not None
            marker = self.markup.think_close if part == REASONING else self.markup.tool_open
            found = body.find(marker)
            if found >= 0:
                body = body[:found]
                if part == CONTENT:
                    self._held = True  # a tool-call block: answered once parsed
            else:
                body = body[: len(body) - _partial_suffix(body, marker)]
            body = body[: max(len(body) - self.hold, 0)]
            visible = body.lstrip().rstrip()
        sent = self.sent[part]
        if len(visible) <= len(sent) or not visible.startswith(sent):
            return []
        self.sent[part] = visible
        return [(part, visible[len(sent) :])]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0

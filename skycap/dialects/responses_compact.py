"""Remote compaction (`POST /v1/responses/compact`) as a Responses call of its own shape.

A client sends the history to compact as a Responses body (`model`, `input`,
`instructions`, `tools`, …) and gets back `{"output": [items]}`: the compacted history it
sends as the input of its next call, which then starts a branch of its own, as a local
compaction's rewritten history does. Text mode forwards it to `{upstream}/responses/compact`
and records it as a call whose reply is that output, kept verbatim as one opaque part
(docs/format.md): it is no assistant turn a harness replays, and the server's compacted
items (such as an encrypted `compaction` item) are its own. Token mode refuses it: what the
API answers is a server-side summary in a form only the API reads back, which no model
call on a prompt of skycap's making could stand in for.
"""

from __future__ import annotations

from typing import Any

from skycap.dialects import CALL, Request, Route
from skycap.dialects.opaque import opaque
from skycap.dialects.responses import ResponsesDialect
from skycap.dialects.responses_read import read_request

#: Token mode's 400 for a remote compaction, naming the route that captures long runs.
TOKEN_REFUSAL = (
    "POST /v1/responses/compact (remote compaction) cannot run in token mode: its answer "
    "is a server-side summary only the OpenAI API reads back. Capture long Codex runs in "
    "token mode through the trajectory's base URL (a model provider whose base_url is "
    "/t/{id}/v1): Codex then compacts with ordinary /v1/responses calls"
)


class CompactionDialect(ResponsesDialect):
    """The compaction route's `Dialect`: Responses' shapes, its own route, upstream path,
    reply and token-mode refusal; calls record `dialect: "responses"` like the rest."""

    upstream_path = b"/responses/compact"
    reply_id_key = None
    routes = (Route("compact", "POST", "responses/compact", "/v1/responses/compact", CALL),)

    def read(self, body: Any) -> Request:
        request = read_request(body)
        request.stream = False  # the API answers a compaction as one JSON body
        request.token_refusal = TOKEN_REFUSAL
        return request

    def reply_message(self, parsed: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
        """The compacted history as the reply: one opaque part holding `output` as sent."""
        output = parsed.get("output")
        if not isinstance(output, list):
            raise ValueError(f"no `output` list in the compaction's answer: {parsed!r:.200}")
        message = {"role": "assistant", "content": [opaque(self.name, {"output": output})]}
        usage = parsed.get("usage")
        return message, "stop", usage if isinstance(usage, dict) else None


DIALECT = CompactionDialect()

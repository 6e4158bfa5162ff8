"""The one table of captured harness routes, built from the dialects' own routes.

Each route (method, path tail after `/t/{id}/v1/`, the suffix matched through the proxy
listener, what it does, the dialect whose shapes it speaks) is written once, in its
dialect's `routes`; the routes every API shares (the model list) are written here. A new
dialect is added to `DIALECTS`. Routing, the access log and the error shape of a caller
on a shared route all read this table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from skycap.dialects import CALL, MODELS, Dialect, Route
from skycap.dialects.chat import DIALECT as CHAT_DIALECT
from skycap.dialects.messages import DIALECT as MESSAGES_DIALECT
from skycap.dialects.responses import DIALECT as RESPONSES_DIALECT
from skycap.dialects.responses_compact import DIALECT as COMPACTION_DIALECT

#: The harness APIs this server captures; the first is the error shape of a caller on a
#: shared route that no other dialect claims.
DIALECTS: tuple[Dialect, ...] = (
    CHAT_DIALECT,
    MESSAGES_DIALECT,
    RESPONSES_DIALECT,
    COMPACTION_DIALECT,
)
#: Routes no one dialect owns: each caller is answered in its own dialect's shape.
SHARED = (Route("models", "GET", "models", "/models", MODELS),)


class RouteTable:
    """The routes of some dialects, looked up by request line or by kind."""

    def __init__(self, dialects: Iterable[Dialect]) -> None:
        self.dialects = tuple(dialects)
        self.default = self.dialects[0]
        owned = [(r, d) for d in self.dialects for r in d.routes]
        entries = [*owned, *((r, None) for r in SHARED)]
        #: kind -> (route, the dialect that owns it, or None for a shared route)
        self.by_kind: dict[str, tuple[Route, Dialect | None]] = {r.kind: (r, d) for r, d in entries}
        self._exact = {(r.tail, r.method): r.kind for r, _ in entries if not r.prefix}
        self._prefixed = [r for r, _ in entries if r.prefix]

    def named(self, method: str, tail: str) -> str | None:
        """The kind of `/t/{id}/{tail}`: exact tails first, then those an id follows."""
        if not tail.startswith("v1/"):
            return None
        tail = tail[3:]
        kind = self._exact.get((tail, method))
        if kind is not None:
            return kind
        for r in self._prefixed:
            if r.method == method and tail.startswith(r.tail):
                return r.kind
        return None

    def proxied(self, method: str, path: str) -> str | None:
        """The kind of a request through the proxy listener, matched by suffix so deployment
        paths (`/openai/deployments/x/chat/completions`) are captured too."""
        for r, _ in self.by_kind.values():
            if r.method == method and not r.prefix and path.endswith(r.proxy):
                return r.kind
        for r in self._prefixed:
            if r.method == method and r.proxy in path:
                return r.kind
        return None

    def dialect_of(self, kind: str | None, headers: Mapping[str, str], host: str = "") -> Dialect:
        """The dialect whose shapes a caller on route `kind` reads.

        A model call's route names it; on any other harness route (a shared one, an unknown
        path, a refusal through the proxy) a dialect claims a caller by the header its
        SDKs send or, failing that, by the API's host; then the route's own dialect.
        """
        route, owner = self.by_kind.get(kind or "", (None, None))
        if route is not None and owner is not None and route.action == CALL:
            return owner
        for dialect in self.dialects:
            if dialect.caller_header is not None and dialect.caller_header in headers:
                return dialect
        for dialect in self.dialects:
            if host and dialect.api_host == host:
                return dialect
        return owner or self.default

    def route(self, kind: str | None) -> Route | None:
        entry = self.by_kind.get(kind or "")
        return None if entry is None else entry[0]


TABLE = RouteTable(DIALECTS)

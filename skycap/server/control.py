"""The control routes of http.md §2: each handler takes the request, returns an Answer.

Every control route needs the control token as `Authorization: Bearer <token>`; only
`GET /healthz` answers without one, and then only `{"ok": ...}` (liveness for probes).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from typing import Any

from skycap.server.answer import Answer
from skycap.server.keys import KEY_PREFIX, bearer_key, raw_header
from skycap.server.proxy import Proxy
from skycap.server.store import TrajectoryStore
from skycap.wire import BodyError, control_error, parse_json_body


def _object_body(raw: bytes) -> dict[str, Any]:
    """The JSON object a control body holds; an empty body is `{}`. Raises BodyError."""
    body = parse_json_body(raw, allow_empty=True)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise BodyError("request body must be a JSON object")
    return body


def _object_member(body: dict[str, Any], name: str) -> dict[str, Any]:
    """An optional object member of a control body; missing or null is `{}`. Raises BodyError."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BodyError(f"`{name}` must be an object")
    return value


# The credential a control request presented.
ACCEPTED, MISSING, HARNESS_KEY, WRONG = "accepted", "missing", "harness-key", "wrong"
CHALLENGE = (
    (b"content-type", b"application/json"),
    (b"www-authenticate", b'Bearer realm="skycap"'),
)
NO_TOKEN = (
    "control routes need the control token: send `Authorization: Bearer <control token>`; "
    "skycap serve prints the file that holds it at start, CaptureService has it as "
    "`service.control_token`"
)
WRONG_TOKEN = "the control token sent is not this server's: send the one it printed at start"
HARNESS_REFUSED = (
    "a trajectory api_key cannot use control routes; they need the server's control token"
)


def _is_harness_key(value: bytes | None) -> bool:
    return value is not None and value.startswith(KEY_PREFIX.encode("ascii"))


#: Set by the `skycap serve --workers N` supervisor: every worker's control port, so that
#: `/healthz` names its siblings and `skycap top` given one worker shows them all.
WORKER_PORTS_VARIABLE = "SKYCAP_WORKER_PORTS"


def _worker_ports() -> list[int] | None:
    value = os.environ.get(WORKER_PORTS_VARIABLE)
    if not value:
        return None
    try:
        return [int(port) for port in value.split(",")]
    except ValueError:
        return None


class Control:
    """The control routes over one store, behind the control token when there is one."""

    def __init__(
        self, store: TrajectoryStore, proxy: Proxy | None = None, token: str | None = None
    ) -> None:
        self.store = store
        self.proxy = proxy
        self._token = None if token is None else token.encode("ascii")
        self._workers = _worker_ports()

    def credential(self, fields: Iterable[tuple[bytes, bytes]]) -> str:
        """What the request's `Authorization` (or a harness's `x-api-key`) presents.

        A trajectory key, sent either way, is told apart from a wrong token (403, not 401)
        by its shape alone; the comparison with the token is constant-time.
        """
        if self._token is None:
            return ACCEPTED
        fields = tuple(fields)
        header = raw_header(fields, b"authorization")
        if not header:
            return HARNESS_KEY if _is_harness_key(raw_header(fields, b"x-api-key")) else MISSING
        sent = bearer_key(header)
        if sent is not None and hmac.compare_digest(sent, self._token):
            return ACCEPTED
        return HARNESS_KEY if _is_harness_key(sent) else WRONG

    @staticmethod
    def refusal(verdict: str) -> tuple[int, bytes]:
        """(status, body) of a refused credential; the 401s carry `CHALLENGE`'s header."""
        if verdict == HARNESS_KEY:
            return 403, control_error(HARNESS_REFUSED, "forbidden")
        message = NO_TOKEN if verdict == MISSING else WRONG_TOKEN
        return 401, control_error(message, "control_token_required")

    def liveness(self) -> Answer:
        """`GET /healthz` without a credential: whether the server is healthy, nothing more
        (503 while a record cannot be written)."""
        ok = self.store.health()["ok"]
        return Answer.json(200 if ok else 503, {"ok": ok})

    def health(self) -> Answer:
        health = self.store.health()
        if self.proxy is not None:
            health["proxy"] = self.proxy.health()
        if self._workers is not None:
            health["workers"] = {"ports": self._workers}
        # A record that cannot be written makes the server unhealthy.
        return Answer.json(200 if health["ok"] else 503, health)

    def listing(self, ended: str | None = None) -> Answer:
        """`GET /trajectories` (live) or `?ended=recent` (a bounded ring of recently ended ones)."""
        if ended is None:
            return Answer.json(200, self.store.listing())
        if ended != "recent":
            return Answer.error(
                400, f"`ended` must be `recent` (the last trajectories ended), got {ended!r}"
            )
        return Answer.json(200, self.store.recent())

    def create(self, raw: bytes, origin: str) -> Answer:
        """`origin` is `scheme://host[:port]` as the trainer reached us."""
        try:
            meta = _object_member(_object_body(raw), "meta")
        except BodyError as exc:
            return Answer.error(400, str(exc))
        live = self.store.create(meta)
        created = {
            "id": live.id,
            "base_url": f"{origin}/t/{live.id}/v1",
            "anthropic_base_url": f"{origin}/t/{live.id}",  # ANTHROPIC_BASE_URL
            "api_key": live.api_key.decode("ascii"),
        }
        if self.proxy is not None:
            created.update(self.proxy.env(live, origin))
        return Answer.json(200, created)

    async def finish(self, trajectory_id: str, raw: bytes) -> Answer:
        try:
            body = _object_body(raw)
            annotations = _object_member(body, "annotations")
            paths = self._paths(body.get("paths"))
        except BodyError as exc:
            return Answer.error(400, str(exc))
        return await self.store.finish(trajectory_id, annotations, paths)

    def _paths(self, paths: Any) -> str | None:
        """The path rule a finish names (None: the default, or the rule already recorded)."""
        if paths is None:
            return None
        if not isinstance(paths, str):
            raise BodyError("`paths` must be a string")
        if not self.store.known_rule(paths):
            raise BodyError(f"`paths` must be one of [{', '.join(self.store.rule_names())}]")
        return paths

    async def document(self, trajectory_id: str) -> Answer:
        return await self.store.document(trajectory_id)

    def record(self, trajectory_id: str) -> Answer:
        return self.store.record_location(trajectory_id)

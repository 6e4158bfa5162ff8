"""The control routes of http.md §2 and D-7: each handler takes the request, returns an Answer."""

from __future__ import annotations

from typing import Any

from skycap.server.proxy import Proxy
from skycap.server.store import Answer, TrajectoryStore
from skycap.wire import BodyError, parse_json_body


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


class Control:
    """The control routes over one store (they are never keyed, http.md §2)."""

    def __init__(self, store: TrajectoryStore, proxy: Proxy | None = None) -> None:
        self.store = store
        self.proxy = proxy

    def health(self) -> Answer:
        health = self.store.health()
        if self.proxy is not None:
            health["proxy"] = self.proxy.health()
        return Answer.json(200, health)

    def listing(self) -> Answer:
        return Answer.json(200, self.store.listing())

    def create(self, raw: bytes, origin: str) -> Answer:
        """`origin` is `scheme://host[:port]` as the trainer reached us (D-9)."""
        try:
            meta = _object_member(_object_body(raw), "meta")
        except BodyError as exc:
            return Answer.error(400, str(exc))
        live = self.store.create(meta)
        created = {
            "id": live.id,
            "base_url": f"{origin}/t/{live.id}/v1",
            "anthropic_base_url": f"{origin}/t/{live.id}",  # D-48: ANTHROPIC_BASE_URL
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

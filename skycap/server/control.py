"""The control routes of http.md §2 and D-7: each handler takes the request, returns an Answer."""

from __future__ import annotations

from typing import Any

from skycap.server.proxy import Proxy
from skycap.server.store import Answer, TrajectoryStore
from skycap.wire import BodyError, parse_json_body


def _object_body(raw: bytes) -> dict[str, Any] | Answer:
    """The JSON object a control body holds; an empty body is `{}`."""
    try:
        body = parse_json_body(raw, allow_empty=True)
    except BodyError as exc:
        return Answer.error(400, str(exc))
    if body is None:
        return {}
    if not isinstance(body, dict):
        return Answer.error(400, "request body must be a JSON object")
    return body


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
        body = _object_body(raw)
        if isinstance(body, Answer):
            return body
        meta = body.get("meta")
        if meta is None:
            meta = {}
        elif not isinstance(meta, dict):
            return Answer.error(400, "`meta` must be an object")
        live = self.store.create(meta)
        created = {
            "id": live.id,
            "base_url": f"{origin}/t/{live.id}/v1",
            "api_key": live.api_key.decode("ascii"),
        }
        if self.proxy is not None:
            created.update(self.proxy.env(live, origin))
        return Answer.json(200, created)

    async def finish(self, trajectory_id: str, raw: bytes) -> Answer:
        body = _object_body(raw)
        if isinstance(body, Answer):
            return body
        annotations = body.get("annotations")
        if annotations is None:
            annotations = {}
        elif not isinstance(annotations, dict):
            return Answer.error(400, "`annotations` must be an object")
        paths = body.get("paths")
        if paths is not None:
            if not isinstance(paths, str):
                return Answer.error(400, "`paths` must be a string")
            if not self.store.known_rule(paths):
                names = ", ".join(self.store.rule_names())
                return Answer.error(400, f"`paths` must be one of [{names}]")
        return await self.store.finish(trajectory_id, annotations, paths)

    async def document(self, trajectory_id: str) -> Answer:
        return await self.store.document(trajectory_id)

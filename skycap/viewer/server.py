"""The viewer's read-only HTTP server: the JSON API under /api/v1 and the static page.

Stdlib `ThreadingHTTPServer` (skycap.local_http), GET and HEAD only, bound to 127.0.0.1 by
default. Listings come from the index's document summaries; a trajectory's sidecars are
decoded here, on open, and sent as compact columns (the browser has no zstd).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
import orjson

from skycap.local_http import LocalHTTPServer
from skycap.record.reader import RecordError, read_sidecar
from skycap.record.remote import MirrorCache
from skycap.record.tokens_kind import TOKEN_ARRAYS
from skycap.viewer import derive
from skycap.viewer.groups import (
    DEFAULT_GROUP_BY,
    GroupSet,
    QueryError,
    build_groups,
    groups_table,
    parse_query,
    rollouts_table,
)
from skycap.viewer.index import MIRROR_INTERVAL, Index, Run
from skycap.viewer.validate import (
    DOCUMENT_SUFFIX,
    document_problems,
    listed_files,
    read_document,
    sidecar_problems,
)

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
PREVIEW_CHARS = 200


class ApiError(Exception):
    """An API answer other than 200: status and a message saying what to do."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class Opened:
    """One trajectory read for the drawer: document, derived graph and sidecar presence."""

    def __init__(self, run: Run, doc_id: str) -> None:
        self.run = run
        self.id = doc_id
        self.document, self.problems = read_document(run.path / f"{doc_id}{DOCUMENT_SUFFIX}")
        if self.document is None:
            raise ApiError(HTTPStatus.UNPROCESSABLE_ENTITY, f"{doc_id}: {self.problems[0]}")
        self.derived = derive.derive(self.document)
        self.present = {
            name for name in listed_files(self.document).values() if (run.path / name).is_file()
        }


class Viewer:
    """The API over an index; each method answers one route with a JSON-ready dict."""

    def __init__(self, index: Index, group_by: tuple[str, ...] = DEFAULT_GROUP_BY) -> None:
        self.index = index
        self.group_by = group_by
        self._groups: OrderedDict[tuple[str, int, tuple[str, ...]], GroupSet] = OrderedDict()
        self._sidecars: OrderedDict[tuple[Path, int], dict[str, np.ndarray] | str] = OrderedDict()
        self._lock = threading.Lock()

    def run(self, name: str) -> Run:
        run = self.index.run(name)
        if run is None:
            known = ", ".join(self.index.runs) or "none yet"
            raise ApiError(HTTPStatus.NOT_FOUND, f"no run named {name!r} (runs: {known})")
        return run

    def groups_of(self, run: Run, keys: tuple[str, ...]) -> GroupSet:
        """The run's groups under `keys`, rebuilt only when the run's version moves."""
        cache_key = (run.name, run.version, keys)
        with self._lock:
            found = self._groups.get(cache_key)
        if found is None:
            found = build_groups(run.snapshot(), keys)
            with self._lock:
                self._groups[cache_key] = found
                while len(self._groups) > 8:
                    self._groups.popitem(last=False)
        return found

    def runs(self) -> dict[str, Any]:
        runs = self.index.listing()
        for info in runs:
            run = self.index.runs[info["name"]]
            groups = self.groups_of(run, self.group_by)
            info["groupable"] = groups.groupable
            info["default_view"] = "groups" if groups.groupable else "rollouts"
        return {"runs": runs, "roots": [str(root) for root in self.index.roots]}

    def table(self, run_name: str, view: str, params: dict[str, str]) -> dict[str, Any]:
        run = self.run(run_name)
        try:
            query = parse_query(params, self.group_by)
        except QueryError as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        groups = self.groups_of(run, query.group_by)
        build = rollouts_table if view == "rollouts" else groups_table
        return {"run": run.name, "version": run.version, **build(run.snapshot(), groups, query)}

    def open(self, run_name: str, doc_id: str) -> Opened:
        run = self.run(run_name)
        if doc_id not in run.summaries:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no trajectory {doc_id!r} in run {run.name!r}")
        return Opened(run, doc_id)

    def trajectory(self, run_name: str, doc_id: str) -> dict[str, Any]:
        """Document, flags, problems (sidecars included), paths, group and train-once check."""
        opened = self.open(run_name, doc_id)
        document, derived = opened.document, opened.derived
        found, _ = sidecar_problems(opened.run.path, document)
        problems = opened.problems + document_problems(document) + found
        flags = derive.rollout_flags(document, derived, opened.present)
        groups = self.groups_of(opened.run, self.group_by)
        reason = derive.text_only_reason(document, derived, opened.present)
        chars = reason is not None or not derive.uses_tokens(derived)
        return {
            "id": doc_id,
            "run": opened.run.name,
            "document": document,
            "flags": [{"flag": f, "level": derive.FLAG_LEVELS[f]} for f in flags],
            "group_flags": groups.group_flags(opened.run.summaries[doc_id]),
            "group": self._group_info(groups, doc_id),
            "problems": problems,
            "absent_sidecars": derive.absent_kinds(document, opened.present),
            "text_only": reason,
            "warning": derive.TEXT_ONLY_WARNING if reason else None,
            "unit": "chars" if chars else "tokens",
            "paths": [self._path_summary(opened, i, chars) for i in range(len(derived.paths))],
            "branch_points": derived.branch_points,
            "train_once": derive.train_once(document, derived),
            "indexed": opened.run.summaries[doc_id].indexed,
        }

    @staticmethod
    def _group_info(groups: GroupSet, doc_id: str) -> dict[str, Any] | None:
        group = groups.of.get(doc_id)
        if group is None:
            return None
        counting = next(
            (c for c, others in group.superseded.items() if any(s.id == doc_id for s in others)),
            None,
        )
        return {
            "key": group.key,
            "flags": group.flags,
            "size": len(group.counting),
            "superseded_by": counting,
            "supersedes": [s.id for s in group.superseded.get(doc_id, [])],
        }

    @staticmethod
    def _path_summary(opened: Opened, index: int, chars: bool) -> dict[str, Any]:
        derived = opened.derived
        counts = derive.path_counts(derived, index)
        blocks = derive.path_blocks(derived, index, chars=chars)
        return {
            "index": index,
            "id": derived.path_id(opened.id, index),
            "leaf": derived.paths[index][-1],
            "nodes": derived.paths[index],
            "tokens": counts.tokens,
            "trainable": counts.trainable,
            "logprobs": counts.logprobs,
            "strip": derive.strip(blocks),
        }

    def _token_arrays(self, opened: Opened) -> dict[str, np.ndarray] | str:
        """The decoded tokens sidecar (cached by file and mtime), or why it cannot be read."""
        name = listed_files(opened.document).get("tokens")
        path = opened.run.path / name if name else opened.run.path
        try:
            key = (path, path.stat().st_mtime_ns)
        except OSError:
            key = (path, 0)
        with self._lock:
            if key in self._sidecars:
                self._sidecars.move_to_end(key)
                return self._sidecars[key]
        try:
            arrays: dict[str, np.ndarray] | str | None = read_sidecar(
                opened.run.path, opened.document, "tokens"
            )
        except (RecordError, ValueError, KeyError) as exc:
            arrays = f"tokens sidecar unreadable: {exc}"
        if isinstance(arrays, dict):
            absent = [name for name in TOKEN_ARRAYS if name not in arrays]
            if absent:  # a hostile or damaged manifest (issue 17): say so, never a 500
                arrays = f"tokens sidecar unreadable: its manifest lists no {absent[0]} array"
        if arrays is None:
            arrays = derive.TEXT_ONLY_WARNING
        with self._lock:
            self._sidecars[key] = arrays
            while len(self._sidecars) > 4:
                self._sidecars.popitem(last=False)
        return arrays

    def path(self, run_name: str, doc_id: str, index: int) -> dict[str, Any]:
        """One path: blocks, and its tokens (or the message-text fallback with a warning)."""
        opened = self.open(run_name, doc_id)
        derived = opened.derived
        if not 0 <= index < len(derived.paths):
            raise ApiError(
                HTTPStatus.NOT_FOUND,
                f"{doc_id} has {len(derived.paths)} paths; path {index} does not exist",
            )
        reason = derive.text_only_reason(opened.document, derived, opened.present)
        arrays: dict[str, np.ndarray] | str | None = None
        warning = derive.TEXT_ONLY_WARNING if reason else None
        if reason is None and derive.uses_tokens(derived):
            arrays = self._token_arrays(opened)
            if isinstance(arrays, str):
                warning, reason = arrays, "tokens-unreadable"
        payload = self._path_summary(opened, index, chars=not isinstance(arrays, dict))
        payload.update(text_only=reason, warning=warning)
        if isinstance(arrays, dict):
            payload["unit"] = "tokens"
            payload["blocks"] = derive.path_blocks(derived, index)
            payload["token_data"] = derive.token_view(derived, index, arrays)
        else:
            payload["unit"] = "chars"
            payload["blocks"] = derive.path_blocks(derived, index, chars=True)
            for block in payload["blocks"]:
                block["text"] = derive.message_text(derived.nodes[block["node"]].get("message"))
            payload["token_data"] = None
        return payload

    def graph(self, run_name: str, doc_id: str) -> dict[str, Any]:
        """Every node with its signs and calls' bridged state, the paths and the forks."""
        from skycap.linearity import MalformedDocument, forks

        opened = self.open(run_name, doc_id)
        derived = opened.derived
        signs = derive.node_signs(derived)
        notes = derive.rerender_notes(derived)
        causes = derive.unbridged_causes(derived)
        nodes = []
        for i, node in enumerate(derived.nodes):
            tokens = derive.node_tokens(node)
            nodes.append(
                {
                    "id": i,
                    "parent": derived.parents[i],
                    "depth": node.get("depth"),
                    "role": node.get("role"),
                    "author": node.get("author"),
                    "children": derived.children[i],
                    "tokens": derive.token_length(node) if tokens is not None else None,
                    "sampled_start": tokens.get("sampled_start") if tokens else None,
                    "shadowed_by": node.get("shadowed_by"),
                    "trained_in": derived.targets.get(i),
                    "signs": signs.get(i, []),
                    "notes": [notes[i]] if i in notes else [],
                    "preview": derive.message_text(node.get("message"))[:PREVIEW_CHARS],
                    "calls": [
                        {
                            "bridged": derive.bridged_state(call),
                            "rerender": _rerender(call, causes.get(i)),
                            "finish_reason": call.get("finish_reason"),
                            "model": call.get("model"),
                            "t_start": call.get("t_start"),
                            "t_end": call.get("t_end"),
                        }
                        for call in derive.calls_of(node)
                    ],
                }
            )
        try:
            found = [
                {
                    "node": f.node,
                    "parent": f.parent,
                    "vs": f.vs,
                    "cause": f.cause,
                    "detail": f.detail,
                }
                for f in forks(opened.document)
            ]
        except MalformedDocument as exc:
            found = [{"error": str(exc)}]
        return {
            "id": doc_id,
            "nodes": nodes,
            "paths": [
                {"index": i, "leaf": path[-1], "nodes": path}
                for i, path in enumerate(derived.paths)
            ],
            "branch_points": derived.branch_points,
            "forks": found,
            "train_once": derive.train_once(opened.document, derived),
        }

    def calls(self, run_name: str, doc_id: str) -> dict[str, Any]:
        """Every call of every model node and every failure, sorted by time."""
        opened = self.open(run_name, doc_id)
        tools = derive.as_dict(opened.document.get("tools"))
        causes = derive.unbridged_causes(opened.derived)
        entries = []
        for i, node in enumerate(opened.derived.nodes):
            for call in derive.calls_of(node):
                start, end = (
                    derive.as_number(call.get("t_start")),
                    derive.as_number(call.get("t_end")),
                )
                key = call.get("tools")
                entries.append(
                    {
                        "kind": "call",
                        "node": i,
                        "t": start,
                        "model": call.get("model"),
                        "duration_ms": None
                        if start is None or end is None
                        else (end - start) * 1000,
                        "finish_reason": call.get("finish_reason"),
                        "bridged": derive.bridged_state(call),
                        "rerender": _rerender(call, causes.get(i)),
                        "usage": call.get("usage"),
                        "sampling": call.get("sampling"),
                        "tools": key,
                        "tool_names": _tool_names(tools.get(key) if isinstance(key, str) else None),
                    }
                )
        for failure in derive.as_list(opened.document.get("failures")):
            failure = derive.as_dict(failure)
            entries.append(
                {
                    "kind": "failure",
                    "node": failure.get("input_leaf"),
                    "t": derive.as_number(failure.get("t")),
                    "status": failure.get("status"),
                    "error": failure.get("error"),
                }
            )
        entries.sort(key=lambda e: (e["t"] is None, e["t"] or 0.0))
        return {"id": doc_id, "calls": entries}


def _rerender(call: Any, cause: str | None) -> str | None:
    """Why an unbridged call's prompt was rendered in full, when a fork explains it."""
    return cause if call.get("bridged") is False else None


def _tool_names(tools: Any) -> list[str]:
    names = []
    for tool in derive.as_list(tools):
        tool = derive.as_dict(tool)
        name = derive.as_dict(tool.get("function")).get("name") or tool.get("name")
        if isinstance(name, str):
            names.append(name)
    return names


Route = tuple[re.Pattern[str], Callable[[re.Match[str], dict[str, str]], dict[str, Any]]]


def _routes(viewer: Viewer) -> list[Route]:
    run, traj = r"(?P<run>[^/]+)", r"(?P<id>[^/]+)"
    base = f"/api/v1/runs/{run}/trajectories/{traj}"
    return [
        (re.compile(r"/api/v1/runs"), lambda m, q: viewer.runs()),
        (
            re.compile(f"/api/v1/runs/{run}/trajectories"),
            lambda m, q: viewer.table(unquote(m["run"]), "rollouts", q),
        ),
        (
            re.compile(f"/api/v1/runs/{run}/groups"),
            lambda m, q: viewer.table(unquote(m["run"]), "groups", q),
        ),
        (re.compile(base), lambda m, q: viewer.trajectory(unquote(m["run"]), unquote(m["id"]))),
        (
            re.compile(base + r"/paths/(?P<index>\d+)"),
            lambda m, q: viewer.path(unquote(m["run"]), unquote(m["id"]), int(m["index"])),
        ),
        (
            re.compile(base + "/graph"),
            lambda m, q: viewer.graph(unquote(m["run"]), unquote(m["id"])),
        ),
        (
            re.compile(base + "/calls"),
            lambda m, q: viewer.calls(unquote(m["run"]), unquote(m["id"])),
        ),
    ]


class Handler(BaseHTTPRequestHandler):
    """GET and HEAD only; every other method is 405. Access lines only when asked for."""

    server: ViewerServer
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; without this, keep-alive answers wait ~40 ms
    # on Nagle's algorithm and the client's delayed ACK.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _refuse(self) -> None:
        self._send(
            HTTPStatus.METHOD_NOT_ALLOWED,
            _json({"error": f"{self.command} is not allowed: the viewer is read-only (GET, HEAD)"}),
            "application/json",
            head=False,
            extra={"Allow": "GET, HEAD"},
        )

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), format % args)

    def _serve(self, *, head: bool) -> None:
        url = urlsplit(self.path)
        if url.path.startswith("/api/"):
            status, body = self._api(url.path.rstrip("/"), url.query)
            self._send(status, body, "application/json", head=head)
            return
        name = _static_name(url.path)
        body = self.server.static.get(name) if name else None
        if body is None:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain", head=head)
            return
        self._send(HTTPStatus.OK, body, CONTENT_TYPES[Path(name).suffix], head=head)

    def _api(self, path: str, query: str) -> tuple[HTTPStatus, bytes]:
        params = {key: values[0] for key, values in parse_qs(query).items()}
        for pattern, answer in self.server.routes:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            try:
                return HTTPStatus.OK, _json(answer(match, params))
            except ApiError as exc:
                return exc.status, _json({"error": str(exc)})
            except orjson.JSONEncodeError as exc:  # e.g. a message nested past 254 levels
                error = f"record error: {path} cannot be shown as JSON: {exc}"
                return HTTPStatus.UNPROCESSABLE_ENTITY, _json({"error": error})
            except Exception as exc:  # one bad record must not take the page down
                error = f"internal error on {path}: {type(exc).__name__}: {exc}"
                logger.error("skycap view: %s", error)
                return HTTPStatus.INTERNAL_SERVER_ERROR, _json({"error": error})
        message = f"no API route {path}; routes start /api/v1/runs"
        return HTTPStatus.NOT_FOUND, _json({"error": message})

    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str,
        *,
        head: bool,
        extra: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


def _static_name(path: str) -> str | None:
    """The static file a page path names: `/` is index.html, the rest live under /static/."""
    if path in ("/", "/index.html"):
        return "index.html"
    return path.removeprefix("/static/") if path.startswith("/static/") else None


def _json(payload: Any) -> bytes:
    return orjson.dumps(payload, option=JSON_OPTIONS)


class ViewerServer(LocalHTTPServer):
    """The HTTP server with its viewer, routes and static files (read once at start)."""

    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], viewer: Viewer) -> None:
        super().__init__(address, Handler)
        self.viewer = viewer
        self.routes = _routes(viewer)
        self.static = {
            path.name: path.read_bytes()
            for path in STATIC_DIR.iterdir()
            if path.suffix in CONTENT_TYPES
        }

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"


def make_server(
    roots: list[Path],
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    group_by: tuple[str, ...] = DEFAULT_GROUP_BY,
    mirrors: list[MirrorCache] | None = None,
    mirror_interval: float = MIRROR_INTERVAL,
) -> ViewerServer:
    """A server over the runs under `roots` and `mirrors`, bound and then indexed (call
    serve_forever). Binding first makes a busy port fail at once rather than after a long
    first index (or a first copy of a mirror).
    """
    index = Index(roots, mirrors=mirrors, mirror_interval=mirror_interval)
    server = ViewerServer((host, port), Viewer(index, group_by))
    index.refresh(force=True)
    return server

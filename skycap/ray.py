"""Capture servers as Ray actors: one CaptureService per actor, placed over a cluster's nodes.

A real RL step runs its rollouts on many nodes, and one capture server is one event loop.
`CaptureServers.start(n)` starts `n` actors, each running a `CaptureService` in its own
worker process, bound to its node's address, with a node-local record directory and the
one control token all servers share. Nothing routes between them: each
trajectory's URL names its server, and the pools from `.pool()` create round-robin.

An actor that dies takes the trajectories it held with it; the watcher thread reports their
ids (from the pools' per-server bookkeeping) and, unless `replace=False`, starts a new actor
in the same placement bundle and swaps its URL into every pool handed out. Needs the `ray`
extra (`pip install 'skycap[ray]'` or `uv sync --extra ray`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skycap.client import CapturePool
from skycap.control_token import new_control_token

try:
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # name the extra
    raise ImportError(
        "skycap.ray needs Ray: install the extra with `pip install 'skycap[ray]'` or "
        "`uv sync --extra ray`"
    ) from exc

__all__ = ["CaptureServers", "LostServer", "default_record_dir"]

logger = logging.getLogger("skycap.ray")

PLACEMENTS = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")


def default_record_dir() -> Path:
    """Each actor's record directory when none is given: `~/skycap-records` on its node."""
    return Path.home() / "skycap-records"


@dataclass(frozen=True)
class LostServer:
    """A capture server (actor) that died, and the trajectories it held, by id."""

    index: int
    url: str
    node: str
    trajectory_ids: tuple[str, ...]
    error: str
    replaced_by: str | None = None


@dataclass(frozen=True)
class ServerInfo:
    """Where one actor's server listens and writes."""

    url: str
    proxy_url: str | None
    node_ip: str
    node_id: str
    record_dir: str | None
    pid: int


def _uv_run_env() -> dict[str, Any] | None:
    """The actors' runtime environment when the job's runs workers through `uv run`, else None.

    Ray's uv hook (a driver started with `uv run`) runs every worker as `uv run … python` in
    a copy of the working directory, which holds no virtualenv: with `--no-sync` that is a
    fresh environment without ray or skycap, and the actors never start (without it, each
    worker first syncs a new environment there). The capture servers run this driver's own
    interpreter instead, where skycap is installed (the same path on every node, as on a
    shared image or filesystem).
    """
    executable = str(ray.get_runtime_context().runtime_env.get("py_executable") or "")
    words = executable.split()
    if len(words) > 1 and Path(words[0]).name == "uv" and words[1] == "run":
        return {"py_executable": sys.executable}
    return None


class _CaptureActor:
    """Runs one CaptureService in this Ray worker process until `stop()`."""

    def __init__(self) -> None:
        self._service: Any = None
        self._stopped = threading.Event()

    def start(self, options: dict[str, Any], record_dir: str | None) -> ServerInfo:
        from skycap.service import CaptureService

        node_ip = ray.util.get_node_ip_address()
        options = dict(options)
        options.setdefault("host", node_ip)
        options.setdefault("advertise_host", node_ip)
        if record_dir is not None:
            options["record_dir"] = record_dir
        elif "record_dir" not in options:
            options["record_dir"] = str(default_record_dir())
        self._service = CaptureService(**options)
        url = self._service.start()
        written = self._service.options.record_dir
        return ServerInfo(
            url=url,
            proxy_url=self._service.proxy_url,
            node_ip=node_ip,
            node_id=ray.get_runtime_context().get_node_id(),
            record_dir=None if written is None else str(written),
            pid=os.getpid(),
        )

    def watch(self) -> bool:
        """Returns once the server stopped; an actor that dies fails this call instead."""
        self._stopped.wait()
        return True

    def stop(self, timeout: float) -> bool:
        """Stop the server: every live trajectory is written before this returns True."""
        try:
            return self._service is None or self._service.stop(timeout)
        finally:
            self._stopped.set()


class CaptureServers:
    """`num_servers` capture servers on a Ray cluster; build with `CaptureServers.start`."""

    def __init__(self) -> None:
        # Built by start(); the fields are documented there.
        self.control_token: str | None = None
        self.lost: list[LostServer] = []
        self.on_lost: Callable[[LostServer], None] | None = None
        self._servers: list[ServerInfo] = []
        self._actors: list[Any] = []
        self._watches: dict[Any, int] = {}
        self._dead: set[int] = set()
        self._pools: weakref.WeakSet[CapturePool] = weakref.WeakSet()
        self._group: PlacementGroup | None = None
        self._own_group = False
        self._options: dict[str, Any] = {}
        self._record_dir: str | None = None
        self._cpus = 1.0
        self._replace = True
        self._timeout = 120.0
        self._runtime_env: dict[str, Any] | None = None
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        num_servers: int,
        *,
        placement: str | PlacementGroup = "SPREAD",
        cpus_per_server: float = 1.0,
        record_dir: str | os.PathLike[str] | None = None,
        replace: bool = True,
        on_lost: Callable[[LostServer], None] | None = None,
        start_timeout: float = 120.0,
        runtime_env: dict[str, Any] | None = None,
        **options: Any,
    ) -> CaptureServers:
        """Start the servers and wait until every one listens.

        `placement` is a strategy for a placement group of `num_servers` bundles of
        `cpus_per_server` CPUs ("SPREAD" puts each on a different node where it can,
        "PACK" fills a node first), or a ready placement group with at least `num_servers`
        bundles (server i goes into bundle i). `record_dir` is a path on each actor's own
        node (default `~/skycap-records` there). Every other keyword is a serve option
        (`CaptureService`'s, e.g. `upstream_url`, `mode`, `tokenizer`); `host` defaults to
        the node's address. A dead actor is reported (`.lost`, a warning, `on_lost`) and,
        with `replace`, started again in its bundle. `runtime_env` is the actors' Ray
        runtime environment (default: the job's, except under `uv run` this driver's
        interpreter; docs/scaling.md "Drivers started with uv run"). Connects to Ray
        (`ray.init()`) if this process has not yet.
        """
        if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
            raise ValueError(f"num_servers must be an integer >= 1, got {num_servers!r}")
        if cpus_per_server <= 0:
            raise ValueError(f"cpus_per_server must be positive, got {cpus_per_server!r}")
        if "port" in options and options["port"] not in (0, None) and num_servers > 1:
            raise ValueError(
                f"port={options['port']}: servers on one node cannot share a port; leave it "
                "out (each server picks a free port)"
            )
        from skycap.server.options import ServerOptions

        token = options.pop("control_token", None)
        if token is None and not options.get("no_control_token"):
            token = new_control_token()
        if token is not None:
            options["control_token"] = token
        # A bad option fails here, before any actor starts (each actor gets a record dir).
        ServerOptions(**{"record_dir": str(record_dir or default_record_dir()), **options})
        if not ray.is_initialized():
            ray.init()
        if runtime_env is None:
            runtime_env = _uv_run_env()
        self = cls()
        self.control_token, self.on_lost = token, on_lost
        self._options, self._cpus, self._replace = options, float(cpus_per_server), replace
        self._record_dir = None if record_dir is None else os.fspath(record_dir)
        self._timeout = start_timeout
        self._runtime_env = runtime_env
        try:
            self._group = self._placement(placement, num_servers)
            actors = self._actors = [self._new_actor(i) for i in range(num_servers)]
            infos = ray.get(
                [a.start.remote(self._options, self._record_dir) for a in actors],
                timeout=start_timeout,
            )
        except BaseException:
            self._teardown()
            raise
        self._servers = list(infos)
        self._watches = {a.watch.remote(): i for i, a in enumerate(actors)}
        self._watcher = threading.Thread(target=self._watch, name="skycap-ray", daemon=True)
        self._watcher.start()
        return self

    def _placement(self, placement: str | PlacementGroup, count: int) -> PlacementGroup:
        if isinstance(placement, PlacementGroup):
            if placement.bundle_count < count:
                raise ValueError(
                    f"the placement group has {placement.bundle_count} bundles for "
                    f"{count} servers: give one bundle per server"
                )
            return placement
        if placement not in PLACEMENTS:
            raise ValueError(
                f"placement={placement!r}: give one of {', '.join(PLACEMENTS)} or a "
                "ray.util.placement_group.PlacementGroup"
            )
        group = placement_group([{"CPU": self._cpus}] * count, strategy=placement)
        self._own_group = True
        try:
            ray.get(group.ready(), timeout=self._timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise TimeoutError(
                f"Ray could not place {count} capture servers of {self._cpus:g} CPUs "
                f"({placement}) within {self._timeout:g} s: the cluster has "
                f"{ray.cluster_resources().get('CPU', 0):g} CPUs; lower cpus_per_server or "
                "num_servers"
            ) from None
        return group

    def _new_actor(self, index: int) -> Any:
        assert self._group is not None
        extra = {} if self._runtime_env is None else {"runtime_env": self._runtime_env}
        remote = ray.remote(_CaptureActor).options(
            **extra,
            num_cpus=self._cpus,
            max_concurrency=4,  # `watch` blocks one thread for the actor's life
            max_restarts=0,  # a restart would lose its trajectories silently: we replace
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=index
            ),
        )
        return remote.remote()

    @property
    def urls(self) -> list[str]:
        """Each server's control URL, in server order (a replaced server's new URL)."""
        with self._lock:
            return [s.url for s in self._servers]

    @property
    def servers(self) -> list[ServerInfo]:
        """Where each server listens and writes: URL, proxy URL, node, record dir."""
        with self._lock:
            return list(self._servers)

    def pool(self, **kwargs: Any) -> CapturePool:
        """A CapturePool over every server with their control token; it follows replaced
        actors, and its open trajectories on a dead one are what `.lost` reports."""
        with self._lock:
            pool = CapturePool(self.urls, control_token=self.control_token, **kwargs)
            self._pools.add(pool)
        return pool

    def _watch(self) -> None:
        """Wait on every actor's `watch` call; one that fails means its actor died."""
        while not self._stopping.is_set():
            with self._lock:
                pending = list(self._watches)
            if not pending:
                return
            done, _ = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    if not self._stopping.is_set():
                        self._died(ref, exc)
                        continue
                with self._lock:
                    self._watches.pop(ref, None)

    def _died(self, ref: Any, exc: BaseException) -> None:
        with self._lock:
            index = self._watches.pop(ref)
            dead = self._servers[index]
        replacement: ServerInfo | None = None
        if self._replace:
            try:
                actor = self._new_actor(index)
                replacement = ray.get(
                    actor.start.remote(self._options, self._record_dir), timeout=self._timeout
                )
            except Exception as start_exc:  # reported below; the other servers serve on
                logger.warning("skycap: could not replace server %s: %s", dead.url, start_exc)
                replacement = None
        lost_ids: list[str] = []
        with self._lock:
            for pool in list(self._pools):
                try:
                    lost_ids += pool.replace_server(
                        dead.url, None if replacement is None else replacement.url
                    )
                except ValueError:  # its only server: keep the URL, calls fail loudly
                    lost_ids += pool.open_trajectories().get(dead.url, [])
            if replacement is not None:
                self._actors[index], self._servers[index] = actor, replacement
                self._watches[actor.watch.remote()] = index
            else:
                self._dead.add(index)
            lost = LostServer(
                index=index,
                url=dead.url,
                node=dead.node_ip,
                trajectory_ids=tuple(lost_ids),
                error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                replaced_by=None if replacement is None else replacement.url,
            )
            self.lost.append(lost)
        logger.warning(
            "skycap: capture server %d at %s on %s died; %d open trajectories lost: %s; %s",
            index,
            dead.url,
            dead.node_ip,
            len(lost_ids),
            ", ".join(lost_ids) or "none",
            f"replaced by {lost.replaced_by}" if lost.replaced_by else "not replaced",
        )
        if self.on_lost is not None:
            self.on_lost(lost)

    def stop(self, timeout: float = 120.0) -> bool:
        """Stop every server, writing each live trajectory's record, then free the actors.

        Returns False (with a warning) if a server did not finish within `timeout`.
        """
        self._stopping.set()
        with self._lock:
            live = [i for i in range(len(self._actors)) if i not in self._dead]
            actors = [self._actors[i] for i in live]
            servers = [self._servers[i] for i in live]
            self._watches.clear()
        ok = True
        refs = [a.stop.remote(timeout) for a in actors]
        for server, ref in zip(servers, refs, strict=True):
            try:
                stopped = ray.get(ref, timeout=timeout + 10)
            except ray.exceptions.RayError as exc:
                logger.warning("skycap: server %s did not stop cleanly: %s", server.url, exc)
                stopped = False
            ok = ok and bool(stopped)
        if self._watcher is not None:
            self._watcher.join(5.0)
        self._teardown()
        return ok

    def _teardown(self) -> None:
        with self._lock:
            actors, self._actors = self._actors, []
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if self._group is not None and self._own_group:
            remove_placement_group(self._group)
        self._group = None

    def __enter__(self) -> CaptureServers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

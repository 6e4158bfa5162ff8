"""SkycapRuntime: the capture servers, pool and step index a SkyRL run uses, started and stopped
from one SkycapConfig; SkycapCallback: SkyRL's step and eval hooks, forwarded to the generator.

Servers are Ray actors (`skycap.ray.CaptureServers`) when Ray is connected or the config asks
for it, else one `CaptureService` in this process; a config of URLs starts nothing. `stop()`
stops what `start` started (every record written, the mirror drained) and closes the index.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from skycap.client import CapturePool
from skycap.index import RecordIndex
from skycap.integrations.skyrl_config import SkycapConfig
from skycap.integrations.skyrl_generator import SkycapGenerator

__all__ = ["SkycapCallback", "SkycapRuntime"]

logger = logging.getLogger("skycap.integrations.skyrl")


class SkycapRuntime:
    """What `start(cfg)` started: `.urls`, `.pool()`, `.generator(cls, **kw)`, `.index`,
    `.stop()`."""

    def __init__(self, config: SkycapConfig) -> None:
        # Built by start(); `servers` is a CaptureServers, a CaptureService, or None (URLs).
        self.config = config
        self.servers: Any = None
        self.urls: list[str] = []
        self.control_token: str | None = None
        self.index: RecordIndex | None = None
        self.on_ray = False
        self._stopped = False

    @classmethod
    def start(cls, config: SkycapConfig | Any, *, wandb_run: Any = None) -> SkycapRuntime:
        """Start the servers `config` asks for (a SkycapConfig or a mapping for
        `SkycapConfig.from_mapping`) and open the step index when W&B is on.

        `wandb_run` is the run the index logs to (default: `wandb.run`, the run SkyRL's
        tracker started).
        """
        if not isinstance(config, SkycapConfig):
            config = SkycapConfig.from_mapping(config)
        self = cls(config)
        try:
            self._start_servers()
            if config.wandb_enabled:
                self.index = RecordIndex(
                    _wandb_run(wandb_run),
                    config.wandb_phases,
                    None if self.on_ray else config.record_dir,
                    config.record_mirror,
                    storage_options=config.record_mirror_config,
                )
        except BaseException:
            self.stop()
            raise
        return self

    def _start_servers(self) -> None:
        config = self.config
        if not config.starts_servers:
            self.urls = list(config.servers)  # type: ignore[arg-type]
            return
        options = config.serve_options()
        if _use_ray(config.ray):
            from skycap.ray import CaptureServers

            servers = CaptureServers.start(
                config.servers,  # type: ignore[arg-type]
                placement=config.placement,
                cpus_per_server=config.cpus_per_server,
                record_dir=config.record_dir,
                runtime_env=None
                if config.ray_runtime_env is None
                else dict(config.ray_runtime_env),
                **options,
            )
            self.servers, self.on_ray = servers, True
            self.urls, self.control_token = servers.urls, servers.control_token
            return
        if config.servers != 1:
            raise ValueError(
                f"skycap.servers is {config.servers} and Ray is not connected: one process runs "
                "one capture server; call ray.init() first (or set skycap.ray: true)"
            )
        from skycap.service import CaptureService

        service = CaptureService(record_dir=config.record_dir, **options)
        self.servers = service
        self.urls = [service.start()]
        self.control_token = service.control_token

    def pool(self, **kwargs: Any) -> CapturePool:
        """A CapturePool over the servers, holding their control token (keywords go to it)."""
        if self.on_ray:
            return self.servers.pool(**kwargs)
        return CapturePool(self.urls, control_token=self.control_token, **kwargs)

    def generator[G: SkycapGenerator](self, cls: type[G], **kwargs: Any) -> G:
        """`cls(pool, mode=…, policy=…, record_dir=…, index=…, **kwargs)` from the config.

        Step and final rows read records from the directory the finish names (on Ray, that
        node's path: give `record_dir=` a shared mount when the trainer runs elsewhere).
        """
        if not (isinstance(cls, type) and issubclass(cls, SkycapGenerator)):
            raise TypeError(f"cls must be a SkycapGenerator subclass, got {cls!r}")
        config = self.config
        options: dict[str, Any] = {
            "mode": config.rows,
            "policy": config.policy,
            "index": self.index,
            "require_experts": config.routed_experts,
        }
        return cls(self.pool(), **{**options, **kwargs})

    def stop(self, timeout: float = 120.0) -> bool:
        """Stop the servers this runtime started (every live trajectory's record written and
        mirrored) and close the index; idempotent. False when something did not finish in
        time (with a warning)."""
        if self._stopped:
            return True
        self._stopped = True
        ok = True
        if self.servers is not None:
            ok = bool(self.servers.stop(timeout))
        if self.index is not None:
            ok = not self.index.close(timeout) and ok
        if not ok:
            logger.warning("skycap: the runtime did not stop cleanly within %g s", timeout)
        return ok

    def __enter__(self) -> SkycapRuntime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class SkycapCallback:
    """SkyRL's `TrainingCallback` events for a SkycapGenerator: each train step and each eval
    pass is indexed when it ends (`trainer.callbacks` takes it; every other event is a no-op).

    The trained ids are every trajectory of the step with a trained token; a trainer that
    filters groups (dynamic sampling) should call `generator.on_step_end` with the ids it
    kept instead.
    """

    def __init__(self, generator: SkycapGenerator) -> None:
        self.generator = generator

    def on_step_end(self, trainer: Any, callback_input: Any, control: Any) -> None:
        self.generator.on_step_end(callback_input.global_step, None, "train")

    def on_eval_end(self, trainer: Any, callback_input: Any, control: Any) -> None:
        self.generator.on_step_end(callback_input.global_step, None, "eval")

    def __getattr__(self, name: str) -> Any:
        """The other events (`on_train_start`, `on_log`, …) do nothing."""
        if name.startswith("on_"):
            return _nothing
        raise AttributeError(name)


def _nothing(*args: Any) -> None:
    return None


def _use_ray(asked: bool | None) -> bool:
    """Ray when asked for, or (not said) when this process is connected to it."""
    if asked is False:
        return False
    if asked is None and importlib.util.find_spec("ray") is None:
        return False
    try:
        import ray
    except ImportError:
        raise ImportError(
            "skycap.ray is true but Ray is not installed: uv sync --extra ray"
        ) from None
    return bool(asked) or ray.is_initialized()


def _wandb_run(run: Any) -> Any:
    if run is not None:
        return run
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "skycap.wandb.enabled needs wandb: uv sync --extra wandb (or set "
            "skycap.wandb.enabled: false)"
        ) from None
    if wandb.run is None:
        raise ValueError(
            "skycap.wandb.enabled is true but no wandb run is active: start the runtime after "
            "SkyRL's tracker (wandb.init), or pass SkycapRuntime.start(cfg, wandb_run=run)"
        )
    return wandb.run

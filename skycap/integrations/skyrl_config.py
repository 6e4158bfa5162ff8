"""SkycapConfig: SkyRL's `cfg.skycap` block (servers, records, mirror, W&B index, serve options,
rows and policy) read from a plain mapping, with every cross-check in one place.

`from_mapping` takes the `skycap` node, or SkyRL's whole config (then the `generator` and
`trainer.logger` settings it must agree with are checked too). Errors are ValueErrors that
name the key, the value and what to do. See docs/skyrl.md "The config block".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from skycap.compose import MODES, Policy

__all__ = ["SkycapConfig", "default_record_dir"]

PLACEMENTS = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
#: Serve options with their own key in the block; any other goes under `serve`.
_SERVE_KEYS = (
    "mode",
    "upstream_url",
    "tokenizer",
    "renderer_name",
    "use_raw_content",
    "renderer_pool_size",
    "ttl",
)


def default_record_dir() -> str:
    """Where records go when the block names no `record_dir`: `~/skycap-records` (on each
    node, for Ray servers)."""
    return str(Path.home() / "skycap-records")


@dataclass(frozen=True)
class SkycapConfig:
    """The `cfg.skycap` block. Build it with `from_mapping`; the fields are its keys.

    `servers`: how many capture servers to start, or the URLs of running ones. `ray`: start
    them as Ray actors (None: when this process is connected to Ray). `serve`: any other
    `skycap serve` option by its Python name.
    """

    servers: int | tuple[str, ...] = 1
    ray: bool | None = None
    placement: str = "SPREAD"
    cpus_per_server: float = 1.0
    ray_runtime_env: Mapping[str, Any] | None = None
    record_dir: str = field(default_factory=default_record_dir)
    record_mirror: str | None = None
    record_mirror_config: Mapping[str, Any] | None = None
    mode: str = "tokens"
    upstream_url: str | None = None
    tokenizer: str | None = None
    renderer_name: str | None = None
    use_raw_content: bool = False
    renderer_pool_size: int = 8
    ttl: float = 3600.0
    serve: Mapping[str, Any] = field(default_factory=dict)
    rows: str = "step"
    policy: Policy = field(default_factory=Policy)
    wandb_enabled: bool = False
    wandb_phases: tuple[str, ...] = ("train",)
    routed_experts: bool = False

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> SkycapConfig:
        """The block from `mapping`: SkyRL's `cfg.skycap` node, or its whole config.

        A mapping with a `skycap` key is read as the whole config: then step and path rows
        need `generator.step_wise_trajectories` on and `generator.merge_stepwise_output` off,
        `wandb.enabled` defaults to whether `trainer.logger` is W&B, and routed experts
        (`generator.inference_engine.enable_return_routed_experts`, R3) are required of
        every capture.
        """
        mapping = _plain(mapping, "the SkyRL config")
        if "skycap" in mapping:
            block = _plain(mapping["skycap"] or {}, "skycap")
            generator = _plain(mapping.get("generator") or {}, "generator")
            trainer = _plain(mapping.get("trainer") or {}, "trainer")
        else:
            block, generator, trainer = mapping, None, None
        known = {f.name for f in fields(cls)} - {"wandb_enabled", "wandb_phases", "routed_experts"}
        unknown = sorted(set(block) - known - {"wandb"})
        if unknown:
            raise ValueError(
                f"skycap.{unknown[0]} is not a skycap setting; the keys are "
                f"{', '.join(sorted(known | {'wandb'}))}"
            )
        values: dict[str, Any] = {k: v for k, v in block.items() if k in known and v is not None}
        if "servers" in values:
            values["servers"] = _servers(values["servers"])
        if "policy" in values:
            values["policy"] = _policy(values["policy"])
        for key in ("serve", "ray_runtime_env", "record_mirror_config"):
            if key in values:
                values[key] = _plain(values[key], f"skycap.{key}")
        wandb = _plain(block.get("wandb") or {}, "skycap.wandb")
        extra = sorted(set(wandb) - {"enabled", "phases"})
        if extra:
            raise ValueError(f"skycap.wandb.{extra[0]} is not a setting: give enabled, phases")
        enabled = wandb.get("enabled")
        if enabled is None:
            enabled = trainer is not None and _uses_wandb(trainer.get("logger"))
        values["wandb_enabled"] = _flag(enabled, "skycap.wandb.enabled")
        if wandb.get("phases") is not None:
            values["wandb_phases"] = _phases(wandb["phases"])
        if generator is not None:
            engine = _plain(generator.get("inference_engine") or {}, "generator.inference_engine")
            values["routed_experts"] = bool(engine.get("enable_return_routed_experts", False))
        config = cls(**values)
        if generator is not None:
            config._check_generator(generator)
        return config

    def __post_init__(self) -> None:
        if self.rows not in MODES:
            raise ValueError(f"skycap.rows must be one of {', '.join(MODES)}, got {self.rows!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"skycap.placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        cpus = self.cpus_per_server
        if isinstance(cpus, bool) or not isinstance(cpus, int | float) or not cpus > 0:
            raise ValueError(f"skycap.cpus_per_server must be a number > 0, got {cpus!r}")
        if self.ray is not None and not isinstance(self.ray, bool):
            raise ValueError(f"skycap.ray must be true, false or null (auto), got {self.ray!r}")
        if self.record_mirror_config is not None and self.record_mirror is None:
            raise ValueError(
                "skycap.record_mirror_config is set but skycap.record_mirror is not: give the "
                "mirror URL (such as s3://bucket/run-7) or drop the config"
            )
        if not isinstance(self.record_dir, str | os.PathLike) or not str(self.record_dir):
            raise ValueError(f"skycap.record_dir must be a path, got {self.record_dir!r}")
        clash = sorted(set(self.serve) & {*_SERVE_KEYS, "record_dir", "record_mirror"})
        if clash:
            raise ValueError(f"skycap.serve.{clash[0]} has its own key: set skycap.{clash[0]}")
        if self.ray is False and self.starts_servers and self.servers != 1:
            raise ValueError(
                f"skycap.servers is {self.servers} with skycap.ray false: one process runs one "
                "capture server, so start several as Ray actors (skycap.ray: true) or give "
                "the URLs of running servers"
            )

    @property
    def starts_servers(self) -> bool:
        """True when `servers` is a count (to start), False for URLs of running servers."""
        return isinstance(self.servers, int)

    def serve_options(self) -> dict[str, Any]:
        """The keywords each started server gets (CaptureService's, `record_dir` aside)."""
        options = {key: getattr(self, key) for key in _SERVE_KEYS}
        options = {k: v for k, v in options.items() if v is not None}
        if self.record_mirror is not None:
            options["record_mirror"] = self.record_mirror
            options["record_mirror_config"] = self.record_mirror_config
        return {**options, **self.serve}

    def _check_generator(self, generator: Mapping[str, Any]) -> None:
        """The generator flags the rows need (SkyRL's `validate_generator_output` asserts one
        row per prompt unless step-wise, and merging would fold rows skycap already split)."""
        step_wise = bool(generator.get("step_wise_trajectories", False))
        if self.rows != "final" and not step_wise:
            raise ValueError(
                f"skycap.rows is {self.rows!r} (several rows per trajectory), which needs "
                "generator.step_wise_trajectories=true; or set skycap.rows: final"
            )
        if step_wise and generator.get("merge_stepwise_output"):
            raise ValueError(
                "generator.merge_stepwise_output must be false with skycap: its rows are "
                "already one per call (set generator.merge_stepwise_output=false)"
            )
        for key in ("zero_reward_on_non_stop", "apply_overlong_filtering"):
            if generator.get(key):
                raise ValueError(
                    f"generator.{key} must be false with skycap: stop reasons are the rollout's "
                    "(complete, agent_timeout, error, context_length), and skycap.policy "
                    "masks overlong rows and zeroes context-length rewards"
                )


def _plain(value: Any, key: str) -> dict[str, Any]:
    """A mapping as a plain dict (an OmegaConf node resolves through `items()`; a dataclass
    config, as SkyRL's own, through its fields)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    if not isinstance(value, Mapping) and not callable(getattr(value, "items", None)):
        raise ValueError(f"{key} must be a mapping, got {type(value).__name__}")
    return {str(k): _plain_value(v) for k, v in value.items()}


def _plain_value(value: Any) -> Any:
    if isinstance(value, str | bytes | int | float | bool) or value is None:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(value, type(value).__name__)
    if isinstance(value, Mapping) or callable(getattr(value, "items", None)):
        return {str(k): _plain_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple) or (
        hasattr(value, "__iter__") and hasattr(value, "__len__")
    ):
        return [_plain_value(v) for v in value]
    return value


def _servers(value: Any) -> int | tuple[str, ...]:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, list) and value and all(isinstance(u, str) and u for u in value):
        return tuple(value)
    raise ValueError(
        f"skycap.servers must be a count >= 1 or a list of capture server URLs, got {value!r}"
    )


def _policy(value: Any) -> Policy:
    options = _plain(value, "skycap.policy")
    try:
        return Policy(**options)
    except TypeError as exc:
        raise ValueError(f"skycap.policy: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"skycap.policy: {exc}") from None


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _phases(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list) or not value:
        raise ValueError(f"skycap.wandb.phases must be a list such as [train, eval], got {value!r}")
    return tuple(str(p) for p in value)


def _uses_wandb(logger: Any) -> bool:
    """SkyRL's `trainer.logger` is one backend name or a list of them."""
    if isinstance(logger, str):
        return logger == "wandb"
    return isinstance(logger, list) and "wandb" in logger

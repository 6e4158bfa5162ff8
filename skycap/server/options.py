"""The one options object that builds a capture server, for `skycap serve`, mitmdump and embedders.

`skycap serve`, the `mitmdump -s addons/skycap.py` script and the embedded
`CaptureService` all build their server from `ServerOptions`; the flags that set it, for
both command lines, are the one table in skycap/server/flags.py.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from skycap.certs import default_confdir
from skycap.control_token import check_control_token, new_control_token
from skycap.dialects.chat import REASONING_FIELDS
from skycap.record.mirror import MirrorConfig, open_store
from skycap.samples import PathRule, build_rules
from skycap.server.destinations import Rule, parse_rule
from skycap.server.flags import (
    ADDON_PREFIX,
    FLAG_OF,
    FLAGS,
    MODES,
    UPSTREAM_AUTH,
)
from skycap.tokens.options import TokenOptions

#: Hosts whose every uncaptured route is refused through the proxy, never forwarded.
MODEL_API_HOSTS = (
    "api.openai.com",
    "api.anthropic.com",
    "*.openai.azure.com",
    "generativelanguage.googleapis.com",
    "*-aiplatform.googleapis.com",
    "bedrock-runtime.*.amazonaws.com",
    "openrouter.ai",
    "api.together.xyz",
    "api.fireworks.ai",
    "api.deepseek.com",
    "api.mistral.ai",
    "api.groq.com",
)
GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class ServerOptions(TokenOptions):
    """Everything a capture server is built from; invalid combinations raise before any start.

    The token-mode options (and `upstream_url`, `api_key`, `upstream_timeout`, which both
    modes read) are TokenOptions', inherited. `upstream_url` may be given positionally;
    every other option is keyword-only, and an unknown keyword raises TypeError
    (docs/python.md "CaptureService(upstream_url, **options)").
    """

    mode: str = "text"
    upstream_auth: str | None = None
    upstream_weight_versions: bool = False
    model_api_hosts: tuple[str, ...] = MODEL_API_HOSTS
    record_dir: str | Path | None = None
    record_host: str | None = None
    journal_fsync: bool = False
    # A URL may carry user:password@ and the config storage_options credentials: never in
    # a repr (logs, tracebacks); the mirror shows its URL redacted.
    record_mirror: str | None = field(default=None, repr=False)
    record_mirror_config: Mapping[str, Any] | None = field(default=None, repr=False)
    ttl: float = 3600.0
    path_rules: Mapping[str, PathRule | str] | None = None
    keep_unrecorded: bool = True
    require_api_key: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = "127.0.0.1"
    max_body_size: int = GIB
    keepalive: float = 15.0
    sweep_interval: float = 60.0
    proxy_port: int | None = None
    confdir: str | Path | None = None
    control_token: str | None = field(default=None, repr=False)
    control_token_file: str | Path | None = None
    no_control_token: bool = False
    proxy_allow: tuple[str, ...] = ()
    proxy_deny: tuple[str, ...] = ()
    rules: dict[str, PathRule] = field(init=False, repr=False, compare=False)
    allow_rules: list[Rule] = field(init=False, repr=False, compare=False)
    deny_rules: list[Rule] = field(init=False, repr=False, compare=False)
    mirror_config: MirrorConfig | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_mode()
        self._check_upstream()
        self._check_numbers()
        self._check_choices()
        self._check_mappings()
        self._settle_control_token()
        if self.record_dir is not None:
            object.__setattr__(self, "record_dir", _record_dir(self.record_dir))
        if self.confdir is not None or self.proxy_port is not None:
            confdir = Path(self.confdir).expanduser().absolute() if self.confdir else None
            object.__setattr__(self, "confdir", confdir or default_confdir())
        if self.keep_unrecorded is False and self.record_dir is not None:
            raise ValueError(
                f"{_name('keep_unrecorded')}=False is for a server with no record_dir; "
                f"drop it or drop {_name('record_dir')}"
            )
        object.__setattr__(self, "rules", build_rules(self.path_rules))
        for key, rules in (("proxy_allow", "allow_rules"), ("proxy_deny", "deny_rules")):
            specs = getattr(self, key)
            if isinstance(specs, str) or not all(isinstance(s, str) for s in specs):
                raise ValueError(f"{_name(key)} must be a list of HOST|CIDR[:PORT] strings")
            object.__setattr__(self, key, tuple(specs))
            object.__setattr__(self, rules, [parse_rule(s, FLAG_OF[key]) for s in specs])
        object.__setattr__(self, "mirror_config", self._check_mirror())

    def _check_mirror(self) -> MirrorConfig | None:
        """The parsed mirror config; the URL is resolved now so a typo or a missing package
        fails at start (ImportError naming the `remote` extra), not at the first finish."""
        if self.record_mirror is None:
            if self.record_mirror_config is not None:
                raise ValueError(
                    f"{_name('record_mirror_config')} configures the record mirror; it needs "
                    f"{_name('record_mirror')}"
                )
            return None
        if not isinstance(self.record_mirror, str) or not self.record_mirror:
            raise ValueError(f"{_name('record_mirror')} must be a URL, got {self.record_mirror!r}")
        if self.record_dir is None:
            raise ValueError(
                f"{_name('record_mirror')} copies records written to the record directory, but "
                f"this server keeps records in memory only: give {_name('record_dir')} or drop "
                f"{_name('record_mirror')}"
            )
        config = MirrorConfig.from_mapping(self.record_mirror_config)
        open_store(self.record_mirror, config.storage_options)
        return config

    def _check_mode(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"{_name('mode')} must be one of {', '.join(MODES)}, got {self.mode!r}"
            )
        if isinstance(self.renderer, str):
            raise ValueError(
                f"renderer= takes a ready renderer object, got the string {self.renderer!r}; "
                f"pass a renderer name as {_name('renderer_name')}"
            )
        if self.mode != "tokens":
            return
        if (self.tokenizer is None) == (self.renderer is None):
            raise ValueError(
                f"token mode needs exactly one of {_name('tokenizer')} or renderer=, got "
                + ("both" if self.tokenizer is not None else "neither")
            )
        if self.renderer is not None:
            for key in ("renderer_name", "chat_template_kwargs"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"{_name(key)} configures the default renderer; it cannot be used "
                        "together with a ready renderer="
                    )

    def _check_upstream(self) -> None:
        if not self.upstream_url:
            if self.mode == "text" and self.proxy_port is not None:
                if self.upstream_weight_versions:
                    raise ValueError(
                        f"{_name('upstream_weight_versions')} asks the {_name('upstream_url')} "
                        "server for weight versions, and none is given: give one or drop it"
                    )
                return  # calls through the proxy go to their original host
            raise ValueError(
                f"{_name('upstream_url')} is required: the model server's OpenAI base URL "
                "including /v1 (text mode) or the engine root (token mode); text mode with "
                f"{_name('proxy_port')} may leave it out"
            )
        parts = urlsplit(self.upstream_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"{_name('upstream_url')} must be an http:// or https:// URL with a host, "
                f"got {self.upstream_url!r}"
            )
        try:
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as exc:
            raise ValueError(f"{_name('upstream_url')} {self.upstream_url!r}: {exc}") from None
        if self.upstream_weight_versions and self.mode != "text":
            raise ValueError(
                f"{_name('upstream_weight_versions')} is a text-mode option: token mode "
                "always reads the engine's weight versions; drop it"
            )
        if self.mode == "tokens" and self.upstream_path.lower().endswith("/v1"):
            # Token mode appends /inference/v1/generate and /v1/models to the root, so a
            # root ending in /v1 would only ever reach /v1/inference/... and /v1/v1/models.
            raise ValueError(
                f"{_name('upstream_url')} {self.upstream_url!r} ends in /v1, but token mode "
                "wants the engine root, e.g. http://engine:8000, not .../v1: drop the /v1"
            )

    def _check_numbers(self) -> None:
        _positive(self.ttl, "ttl")
        _positive(self.sweep_interval, "sweep_interval")
        if self.upstream_timeout is not None:
            _positive(self.upstream_timeout, "upstream_timeout")
        _positive(self.keepalive, "keepalive")
        _integer(self.max_body_size, "max_body_size", low=1)
        _integer(self.renderer_pool_size, "renderer_pool_size", low=1)
        _integer(self.render_cache_mib, "render_cache_mib", low=0)
        _integer(self.port, "port", low=0, high=65535)
        if self.proxy_port is not None:
            _integer(self.proxy_port, "proxy_port", low=0, high=65535)
            if self.proxy_port == self.port != 0:
                raise ValueError(
                    f"{_name('proxy_port')} must differ from {_name('port')}, got {self.port} "
                    "for both"
                )
        if self.max_model_len is not None:
            _integer(self.max_model_len, "max_model_len", low=1)

    def _check_choices(self) -> None:
        if self.reasoning_field not in REASONING_FIELDS:
            raise ValueError(
                f"{_name('reasoning_field')} must be one of {', '.join(REASONING_FIELDS)}, "
                f"got {self.reasoning_field!r}"
            )
        if self.upstream_auth is not None and self.upstream_auth not in UPSTREAM_AUTH:
            raise ValueError(
                f"{_name('upstream_auth')} must be one of {', '.join(UPSTREAM_AUTH)}, "
                f"got {self.upstream_auth!r}"
            )
        hosts = self.model_api_hosts
        if isinstance(hosts, str) or not all(isinstance(h, str) and h for h in hosts):
            raise ValueError(
                f"{_name('model_api_hosts')} must be a sequence of host names or patterns, "
                f"got {hosts!r}"
            )
        object.__setattr__(self, "model_api_hosts", tuple(h.lower() for h in hosts))

    def _settle_control_token(self) -> None:
        """The control token is the one given, else generated here, unless turned off."""
        if self.no_control_token:
            for key in ("control_token", "control_token_file"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"{_name('no_control_token')} turns the control token off; drop it or "
                        f"drop {_name(key)}"
                    )
            return
        if self.control_token is None:
            object.__setattr__(self, "control_token", new_control_token())
        elif not isinstance(self.control_token, str):
            raise ValueError(
                f"{_name('control_token')} must be a string, "
                f"got {type(self.control_token).__name__}"
            )
        else:
            check_control_token(self.control_token, _name("control_token"))
        if self.control_token_file is not None:
            path = Path(self.control_token_file).expanduser().absolute()
            object.__setattr__(self, "control_token_file", path)

    def _check_mappings(self) -> None:
        for key in ("chat_template_kwargs", "sampling_overrides", "path_rules"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"{_name(key)} must be a mapping, got {type(value).__name__}")

    @property
    def upstream_origin(self) -> tuple[str, str, int]:
        """(scheme, host, port) of `upstream_url`, where harness calls are re-targeted."""
        assert self.upstream_url, "no upstream_url (text mode behind --proxy-port only)"
        parts = urlsplit(self.upstream_url)
        assert parts.hostname is not None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return parts.scheme, parts.hostname, port

    @property
    def upstream_path(self) -> str:
        """The path of `upstream_url` without a trailing slash (text mode: ends in /v1)."""
        return urlsplit(self.upstream_url).path.rstrip("/")

    @property
    def binds_beyond_loopback(self) -> bool:
        """Whether `host` is reachable from other machines (binding wider is logged as a
        warning)."""
        if self.host in ("localhost",):
            return False
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return True


def _record_dir(value: str | Path) -> Path:
    """Absolute and created if missing, so a bad directory fails before the server starts."""
    path = Path(value).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"{_name('record_dir')} {str(path)!r} cannot be created: {exc.strerror or exc}"
        ) from None
    return path


def _name(keyword: str) -> str:
    """A keyword with its CLI flag, so one message serves embedders and `skycap serve` users."""
    flag = FLAG_OF.get(keyword)
    return f"{keyword} ({flag})" if flag else keyword


def _positive(value: Any, keyword: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{_name(keyword)} must be a positive number of seconds, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{_name(keyword)} must be finite, got {value!r}")


def _integer(value: Any, keyword: str, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_name(keyword)} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{_name(keyword)} must be {bound}, got {value}")


def from_values(values: Mapping[str, Any], **extra: Any) -> ServerOptions:
    """Build options from raw flag values keyed by `Flag.dest` (argparse or mitmproxy options).

    Absent values (None, False, an empty list) keep the ServerOptions default. Raises
    ValueError with a message naming the flag or keyword at fault.
    """
    kwargs: dict[str, Any] = {}
    for flag in FLAGS:
        if flag.dest not in values:
            continue
        raw = values[flag.dest]
        if raw is None or raw is False or raw == [] or raw == ():
            continue
        if flag.switch:
            kwargs[flag.keyword] = True
        elif flag.repeat:
            kwargs[flag.keyword] = flag.convert(list(raw))
        else:
            kwargs[flag.keyword] = flag.convert(raw)
    if values.get("mode") == "tokens" and not values.get("tokenizer"):
        raise ValueError("--mode tokens needs --tokenizer")
    return ServerOptions(**kwargs, **extra)


def add_addon_options(loader: Any) -> None:
    """Register `skycap_<flag>` mitmproxy options for the flags that apply under mitmdump."""
    from collections.abc import Sequence
    from typing import Optional

    for flag in FLAGS:
        if not flag.addon:
            continue
        name = ADDON_PREFIX + flag.dest
        if flag.switch:
            loader.add_option(name, bool, False, flag.help)
        elif flag.repeat:
            loader.add_option(name, Sequence[str], [], flag.help)
        else:
            loader.add_option(name, Optional[str], flag.default, flag.help)  # noqa: UP045


def from_addon_options(opts: Any) -> ServerOptions:
    """Build options from a mitmproxy options object carrying the `skycap_*` options.

    Under mitmdump the proxy listener and its CA are mitmproxy's own options: a
    `--mode regular@PORT` turns the proxy on, and `confdir` holds the CA.
    """
    values = {flag.dest: getattr(opts, ADDON_PREFIX + flag.dest) for flag in FLAGS if flag.addon}
    return from_values(values, **_mitmproxy_proxy(opts))


def _mitmproxy_proxy(opts: Any) -> dict[str, Any]:
    """`proxy_port` and `confdir` from mitmproxy's `mode` and `confdir` options, if any."""
    from mitmproxy.proxy.mode_specs import ProxyMode, RegularMode

    if "mode" not in opts:
        return {}
    for spec in opts.mode:
        mode = ProxyMode.parse(spec)
        if isinstance(mode, RegularMode):
            port = mode.listen_port(opts.listen_port if "listen_port" in opts else None)
            return {"proxy_port": port, "confdir": opts.confdir}
    return {}

"""The one options object that builds a capture server, for `skycap serve`, mitmdump and embedders.

D-20: `skycap serve`, the `mitmdump -s addons/skycap.py` script and the embedded
`CaptureService` all build their server from `ServerOptions`, and both command-line
surfaces are generated from the single `FLAGS` table below, so they cannot drift.

| CLI flag (`skycap serve`) | keyword (`ServerOptions`, `CaptureService`) | mitmdump `--set` |
|---|---|---|
| `--mode {text,tokens}` | `mode` | `skycap_mode` |
| `--upstream-url URL` | `upstream_url` | `skycap_upstream_url` |
| `--upstream-api-key-env NAME` | `api_key` (read from NAME) | `skycap_upstream_api_key_env` |
| `--host HOST` | `host` | mitmproxy's `--listen-host` |
| `--port PORT` (default 8080) | `port` (default 0) | mitmproxy's `--listen-port` |
| `--tokenizer NAME` | `tokenizer` | `skycap_tokenizer` |
| `--renderer NAME` | `renderer_name` | `skycap_renderer` |
| `--renderer-pool-size N` | `renderer_pool_size` | `skycap_renderer_pool_size` |
| `--chat-template-kwargs JSON` | `chat_template_kwargs` | `skycap_chat_template_kwargs` |
| `--model NAME` | `model` | `skycap_model` |
| `--max-model-len N` | `max_model_len` | `skycap_max_model_len` |
| `--sampling-overrides JSON` | `sampling_overrides` | `skycap_sampling_overrides` |
| `--sampling-mask` | `sampling_mask` | `skycap_sampling_mask` |
| `--logprobs-mode MODE` | `logprobs_mode` | `skycap_logprobs_mode` |
| `--use-raw-content` | `use_raw_content` | `skycap_use_raw_content` |
| `--keep-special-tokens` | `keep_special_tokens` | `skycap_keep_special_tokens` |
| `--generation-config MODE` | `generation_config` | `skycap_generation_config` |
| `--reasoning-field FIELD` | `reasoning_field` | `skycap_reasoning_field` |
| `--upstream-auth {bearer,x-api-key}` | `upstream_auth` (D-37) | `skycap_upstream_auth` |
| `--model-api-host HOST` (repeat) | `model_api_hosts` (D-38) | `skycap_model_api_host` |
| `--record-dir DIR` | `record_dir` | `skycap_record_dir` |
| `--record-host ADDRESS` | `record_host` | `skycap_record_host` |
| `--journal-fsync` | `journal_fsync` (D-44) | `skycap_journal_fsync` |
| `--record-mirror URL` | `record_mirror` | `skycap_record_mirror` |
| `--record-mirror-config JSON` | `record_mirror_config` | `skycap_record_mirror_config` |
| `--ttl SECONDS` | `ttl` | `skycap_ttl` |
| `--path-rule [NAME=]MODULE:FUNCTION` (repeat) | `path_rules` (name -> rule) | `skycap_path_rule` |
| `--require-api-key` | `require_api_key` | `skycap_require_api_key` |
| `--max-body-size BYTES` | `max_body_size` (D-10) | `skycap_max_body_size` |
| `--upstream-timeout SECONDS` | `upstream_timeout` (D-11) | `skycap_upstream_timeout` |
| `--proxy-port PORT` | `proxy_port` (default None: off) | mitmproxy's `--mode regular@PORT` |
| `--confdir DIR` | `confdir` (the proxy's CA) | mitmproxy's `--set confdir=DIR` |
| `--control-token-env NAME` | `control_token` (read from NAME) | `skycap_control_token_env` |
| `--control-token-file PATH` | `control_token_file` | `skycap_control_token_file` |
| `--no-control-token` | `no_control_token` | `skycap_no_control_token` |
| `--proxy-allow RULE` (repeat; HOST or CIDR[:PORT]) | `proxy_allow` (D-43) | `skycap_proxy_allow` |
| `--proxy-deny RULE` (repeat) | `proxy_deny` (D-43) | `skycap_proxy_deny` |
| (none) | `renderer` (a ready renderer object) | (none) |
| (none) | `engine` (the engine wire object) | (none) |
| (none) | `keep_unrecorded` | (none) |
| (none) | `advertise_host` | (none) |
| (none) | `sweep_interval` (D-13) | (none) |

Exposures, the harness listener and `processor_kwargs` are not built yet (D-3).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from skycap.certs import default_confdir
from skycap.control_token import check_control_token, new_control_token
from skycap.dialects.chat import REASONING_FIELDS
from skycap.record.mirror import MirrorConfig, open_store
from skycap.samples import BUILTIN_RULES, PathRule, build_rules, parse_rule_option
from skycap.server.destinations import Rule, parse_rule

MODES = ("text", "tokens")
UPSTREAM_AUTH = ("bearer", "x-api-key")
#: D-38: hosts whose every uncaptured route is refused through the proxy, never forwarded.
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
DEFAULT_API_KEY_ENV = "SKYCAP_UPSTREAM_API_KEY"
GIB = 1 << 30


@dataclass(frozen=True)
class ServerOptions:
    """Everything a capture server is built from; invalid combinations raise before any start.

    `upstream_url` may be given positionally; every other option is keyword-only, and an
    unknown keyword raises TypeError (python-api.md §2).
    """

    upstream_url: str | None = None
    _: KW_ONLY
    mode: str = "text"
    api_key: str | None = None
    tokenizer: str | None = None
    renderer: Any = None
    renderer_pool_size: int = 8
    renderer_name: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    engine: Any = None
    model: str | None = None
    max_model_len: int | None = None
    sampling_overrides: Mapping[str, Any] | None = None
    sampling_mask: bool = False
    logprobs_mode: str = "processed_logprobs"
    use_raw_content: bool = False
    keep_special_tokens: bool = False
    generation_config: str | None = None
    reasoning_field: str = "both"
    upstream_auth: str | None = None
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
    upstream_timeout: float | None = None
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
            object.__setattr__(self, rules, [parse_rule(s, _FLAG_OF[key]) for s in specs])
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
                return  # D-8: calls through the proxy go to their original host
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
        _integer(self.max_body_size, "max_body_size", low=1)
        _integer(self.renderer_pool_size, "renderer_pool_size", low=1)
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
        """D-30: the control token is the one given, else generated here, unless turned off."""
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
        """(scheme, host, port) of `upstream_url`, where harness calls are re-targeted (D-8)."""
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
        """Whether `host` is reachable from other machines (D-6 logs this as a warning)."""
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
    flag = _FLAG_OF.get(keyword)
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


# -- the command-line surfaces ---------------------------------------------------------------


def _json_object(flag: str) -> Callable[[str], dict[str, Any]]:
    def convert(text: str) -> dict[str, Any]:
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{flag} must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{flag} must be a JSON object, got {text!r:.60}")
        return value

    return convert


def _number(kind: type, flag: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise ValueError(f"{flag} must be {noun}, got {text!r}") from None

    return convert


def _api_key_from_env(name: str) -> str | None:
    """`--upstream-api-key-env NAME` names a variable; the key itself never sits in argv."""
    return os.environ.get(name) or None


def _control_token_from_env(name: str) -> str:
    """`--control-token-env NAME`: the token sits in a variable, never in argv."""
    token = os.environ.get(name)
    if not token:
        raise ValueError(
            f"--control-token-env {name}: the variable {name} is not set or empty; export the "
            "token in it, or drop the flag to have a token generated"
        )
    return check_control_token(token, f"--control-token-env {name}")


def _path_rules(specs: list[str]) -> dict[str, str]:
    rules: dict[str, str] = {}
    for spec in specs:
        name, target = parse_rule_option(spec)
        if name in rules:
            raise ValueError(f"--path-rule {name!r} is given twice; give each rule a distinct name")
        if name in BUILTIN_RULES:
            raise ValueError(f"--path-rule name {name!r} is built in; choose another name")
        rules[name] = target
    return rules


@dataclass(frozen=True)
class Flag:
    """One `skycap serve` flag, the keyword it sets and (with `addon`) its mitmdump option."""

    flag: str
    keyword: str
    help: str
    convert: Callable[[Any], Any] | None = str
    default: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    repeat: bool = False
    addon: bool = True

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def switch(self) -> bool:
        return self.convert is None and not self.repeat


FLAGS: tuple[Flag, ...] = (
    Flag("--mode", "mode", "capture mode", default="text", choices=MODES),
    Flag(
        "--upstream-url",
        "upstream_url",
        "text mode: the model server's OpenAI base URL including /v1; token mode: the "
        "engine root (required, except in text mode with --proxy-port)",
        metavar="URL",
    ),
    Flag(
        "--upstream-api-key-env",
        "api_key",
        "environment variable holding the key sent upstream as a Bearer token "
        f"(default {DEFAULT_API_KEY_ENV})",
        convert=_api_key_from_env,
        default=DEFAULT_API_KEY_ENV,
        metavar="NAME",
    ),
    Flag(
        "--host",
        "host",
        "bind address (default 127.0.0.1; binding wider lets other machines reach the "
        "harness routes and ask the control routes for the control token)",
        default="127.0.0.1",
        addon=False,
    ),
    Flag(
        "--port",
        "port",
        "bind port (default 8080; 0 lets the OS choose)",
        convert=_number(int, "--port"),
        default="8080",
        addon=False,
    ),
    Flag("--tokenizer", "tokenizer", "token mode: tokenizer name or folder", metavar="NAME"),
    Flag("--renderer", "renderer_name", "token mode: renderer name", metavar="NAME"),
    Flag(
        "--renderer-pool-size",
        "renderer_pool_size",
        "token mode: renderer slots (default 8)",
        convert=_number(int, "--renderer-pool-size"),
        metavar="N",
    ),
    Flag(
        "--chat-template-kwargs",
        "chat_template_kwargs",
        "token mode: JSON object passed to the chat template",
        convert=_json_object("--chat-template-kwargs"),
        metavar="JSON",
    ),
    Flag(
        "--model",
        "model",
        "model name sent to the engine and listed on /models (token mode default: the "
        "engine's served name from its /v1/models)",
    ),
    Flag(
        "--max-model-len",
        "max_model_len",
        "token mode: context length used to clamp max_tokens and refuse long prompts",
        convert=_number(int, "--max-model-len"),
        metavar="N",
    ),
    Flag(
        "--sampling-overrides",
        "sampling_overrides",
        "token mode: JSON object of sampling parameters imposed on every call",
        convert=_json_object("--sampling-overrides"),
        metavar="JSON",
    ),
    Flag("--sampling-mask", "sampling_mask", "token mode: ask for sampling masks", convert=None),
    Flag(
        "--logprobs-mode",
        "logprobs_mode",
        "token mode: recorded in capture only (default processed_logprobs); must match "
        "vLLM's own --logprobs-mode, whose default is raw_logprobs",
        metavar="MODE",
    ),
    Flag(
        "--use-raw-content",
        "use_raw_content",
        "token mode: reply with the completion's raw decoded text",
        convert=None,
    ),
    Flag(
        "--keep-special-tokens",
        "keep_special_tokens",
        "token mode: decode raw content and match stop strings with special tokens kept "
        "(vLLM's skip_special_tokens=false; default: skipped, as vLLM does)",
        convert=None,
    ),
    Flag(
        "--generation-config",
        "generation_config",
        "token mode: sampling defaults for fields a request omits: auto (the tokenizer "
        "folder's generation_config.json, if any; the default), none, or a file or folder",
        metavar="auto|none|PATH",
    ),
    Flag(
        "--reasoning-field",
        "reasoning_field",
        "token mode: the chat reply key(s) carrying the reasoning text (default both)",
        default="both",
        choices=REASONING_FIELDS,
    ),
    Flag(
        "--record-dir",
        "record_dir",
        "record directory; without it trajectories stay in memory and never expire",
        metavar="DIR",
    ),
    Flag(
        "--record-host",
        "record_host",
        "record.host in finish replies (default: this machine's primary address)",
        metavar="ADDRESS",
    ),
    Flag(
        "--journal-fsync",
        "journal_fsync",
        "fsync each crash-journal line before the answer (survives power loss, not only a "
        "killed server; costs a disk flush per call)",
        convert=None,
    ),
    Flag(
        "--record-mirror",
        "record_mirror",
        "also copy every record, in the background, to this fsspec URL (s3://bucket/prefix, "
        "gs://..., file:///...); needs the remote extra and --record-dir",
        metavar="URL",
    ),
    Flag(
        "--record-mirror-config",
        "record_mirror_config",
        "JSON object: exclude, workers, queue_size, timeout, attempts, backoff, "
        "shutdown_timeout, storage_options (passed to fsspec)",
        convert=_json_object("--record-mirror-config"),
        metavar="JSON",
    ),
    Flag(
        "--ttl",
        "ttl",
        "idle seconds before an unfinished trajectory is abandoned (default 3600)",
        convert=_number(float, "--ttl"),
        metavar="SECONDS",
    ),
    Flag(
        "--path-rule",
        "path_rules",
        "custom path rule, repeatable; without NAME= it is named by its import path",
        convert=_path_rules,
        metavar="[NAME=]MODULE:FUNCTION",
        repeat=True,
    ),
    Flag(
        "--require-api-key",
        "require_api_key",
        "require each trajectory's api_key on the harness routes",
        convert=None,
    ),
    Flag(
        "--max-body-size",
        "max_body_size",
        "largest accepted request body in bytes (default 1 GiB); larger bodies get 413",
        convert=_number(int, "--max-body-size"),
        metavar="BYTES",
    ),
    Flag(
        "--upstream-timeout",
        "upstream_timeout",
        "seconds an upstream call may go without progress before it fails with 502 "
        "(default: no limit)",
        convert=_number(float, "--upstream-timeout"),
        metavar="SECONDS",
    ),
    Flag(
        "--upstream-auth",
        "upstream_auth",
        "how the upstream key is sent: bearer (Authorization), or x-api-key (default: "
        "x-api-key for api.anthropic.com, else bearer)",
        choices=UPSTREAM_AUTH,
        metavar="{bearer,x-api-key}",
    ),
    Flag(
        "--model-api-host",
        "model_api_hosts",
        "through the proxy, a host (fnmatch pattern) whose uncaptured routes are refused, "
        "never forwarded; repeatable, replaces the default list (docs/proxy.md)",
        convert=tuple,
        metavar="HOST",
        repeat=True,
    ),
    Flag(
        "--proxy-port",
        "proxy_port",
        "also listen as an HTTPS_PROXY on this port (0 lets the OS choose); a trajectory is "
        "named by the proxy credentials that POST /trajectories returns",
        convert=_number(int, "--proxy-port"),
        metavar="PORT",
        addon=False,
    ),
    Flag(
        "--proxy-allow",
        "proxy_allow",
        "let pass-through reach this loopback or link-local host, address or network "
        "(repeatable; the proxy refuses them by default)",
        convert=tuple,
        metavar="HOST|CIDR[:PORT]",
        repeat=True,
    ),
    Flag(
        "--proxy-deny",
        "proxy_deny",
        "refuse pass-through to this host, address or network too (repeatable; wins over "
        "--proxy-allow)",
        convert=tuple,
        metavar="HOST|CIDR[:PORT]",
        repeat=True,
    ),
    Flag(
        "--confdir",
        "confdir",
        "directory of the proxy's CA and CA bundle (default $XDG_CONFIG_HOME/skycap or "
        "~/.config/skycap)",
        metavar="DIR",
        addon=False,
    ),
    Flag(
        "--control-token-env",
        "control_token",
        "environment variable holding the control token that control routes require "
        "(default: a new token at each start)",
        convert=_control_token_from_env,
        metavar="NAME",
    ),
    Flag(
        "--control-token-file",
        "control_token_file",
        "file the control token is written to, mode 0600 (default <confdir>/control-token-<port>)",
        metavar="PATH",
    ),
    Flag(
        "--no-control-token",
        "no_control_token",
        "serve the control routes without a credential: any harness can then list, create "
        "and finish trajectories (a warning at start)",
        convert=None,
    ),
)

_FLAG_OF = {f.keyword: f.flag for f in FLAGS}
ADDON_PREFIX = "skycap_"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every serve flag of `FLAGS` to `parser` (values stay text until `from_values`)."""
    for flag in FLAGS:
        if flag.switch:
            parser.add_argument(flag.flag, dest=flag.dest, action="store_true", help=flag.help)
        elif flag.repeat:
            parser.add_argument(
                flag.flag, dest=flag.dest, action="append", metavar=flag.metavar, help=flag.help
            )
        else:
            parser.add_argument(
                flag.flag,
                dest=flag.dest,
                default=flag.default,
                metavar=flag.metavar,
                choices=flag.choices,
                help=flag.help,
            )


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

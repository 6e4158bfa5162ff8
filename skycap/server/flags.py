"""The `skycap serve` flags and their mitmdump options, from one table so the two cannot drift.

Both command-line surfaces are generated from the single `FLAGS` table below; each
flag sets one `ServerOptions` keyword (skycap/server/options.py).

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
| `--render-cache-mib N` | `render_cache_mib` | `skycap_render_cache_mib` |
| `--chat-template-kwargs JSON` | `chat_template_kwargs` | `skycap_chat_template_kwargs` |
| `--model NAME` | `model` | `skycap_model` |
| `--max-model-len N` | `max_model_len` | `skycap_max_model_len` |
| `--sampling-overrides JSON` | `sampling_overrides` | `skycap_sampling_overrides` |
| `--sampling-mask` | `sampling_mask` | `skycap_sampling_mask` |
| `--logprobs-mode MODE` | `logprobs_mode` | `skycap_logprobs_mode` |
| `--use-raw-content` | `use_raw_content` | `skycap_use_raw_content` |
| `--keep-special-tokens` | `keep_special_tokens` | `skycap_keep_special_tokens` |
| `--engine-wire WIRE` (`vllm`, `MODULE:CLASS`) | `engine` (a wire object) | `skycap_engine_wire` |
| `--generation-config MODE` | `generation_config` | `skycap_generation_config` |
| `--reasoning-field FIELD` | `reasoning_field` | `skycap_reasoning_field` |
| `--upstream-auth {bearer,x-api-key}` | `upstream_auth` | `skycap_upstream_auth` |
| `--upstream-weight-versions` | `upstream_weight_versions` | `skycap_upstream_weight_versions` |
| `--model-api-host HOST` (repeat) | `model_api_hosts` | `skycap_model_api_host` |
| `--record-dir DIR` | `record_dir` | `skycap_record_dir` |
| `--record-host ADDRESS` | `record_host` | `skycap_record_host` |
| `--journal-fsync` | `journal_fsync` | `skycap_journal_fsync` |
| `--record-mirror URL` | `record_mirror` | `skycap_record_mirror` |
| `--record-mirror-config JSON` | `record_mirror_config` | `skycap_record_mirror_config` |
| `--ttl SECONDS` | `ttl` | `skycap_ttl` |
| `--path-rule [NAME=]MODULE:FUNCTION` (repeat) | `path_rules` (name -> rule) | `skycap_path_rule` |
| `--require-api-key` | `require_api_key` | `skycap_require_api_key` |
| `--max-body-size BYTES` | `max_body_size` | `skycap_max_body_size` |
| `--upstream-timeout SECONDS` | `upstream_timeout` | `skycap_upstream_timeout` |
| `--keepalive SECONDS` | `keepalive` | `skycap_keepalive` |
| `--proxy-port PORT` | `proxy_port` (default None: off) | mitmproxy's `--mode regular@PORT` |
| `--confdir DIR` | `confdir` (the proxy's CA) | mitmproxy's `--set confdir=DIR` |
| `--control-token-env NAME` | `control_token` (read from NAME) | `skycap_control_token_env` |
| `--control-token-file PATH` | `control_token_file` | `skycap_control_token_file` |
| `--no-control-token` | `no_control_token` | `skycap_no_control_token` |
| `--proxy-allow RULE` (repeat; HOST or CIDR[:PORT]) | `proxy_allow` | `skycap_proxy_allow` |
| `--proxy-deny RULE` (repeat) | `proxy_deny` | `skycap_proxy_deny` |
| (none) | `renderer` (a ready renderer object) | (none) |
| (none) | `keep_unrecorded` | (none) |
| (none) | `advertise_host` | (none) |
| (none) | `sweep_interval` | (none) |

"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from skycap.control_token import check_control_token
from skycap.dialects.chat import REASONING_FIELDS
from skycap.samples import BUILTIN_RULES, parse_rule_option
from skycap.tokens.engine import load_wire

MODES = ("text", "tokens")
UPSTREAM_AUTH = ("bearer", "x-api-key")
DEFAULT_API_KEY_ENV = "SKYCAP_UPSTREAM_API_KEY"


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
    Flag("--mode", "mode", "capture mode (default text)", default="text", choices=MODES),
    Flag(
        "--upstream-url",
        "upstream_url",
        "text mode: the model server's OpenAI base URL including /v1; token mode: the "
        "engine root (no default: required, except in text mode with --proxy-port)",
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
    Flag(
        "--tokenizer",
        "tokenizer",
        "token mode: tokenizer name or folder (no default: required in token mode)",
        metavar="NAME",
    ),
    Flag(
        "--renderer",
        "renderer_name",
        "token mode: renderer name (default: chosen from the tokenizer's name)",
        metavar="NAME",
    ),
    Flag(
        "--renderer-pool-size",
        "renderer_pool_size",
        "token mode: renderer slots (default 8)",
        convert=_number(int, "--renderer-pool-size"),
        metavar="N",
    ),
    Flag(
        "--render-cache-mib",
        "render_cache_mib",
        "token mode: MiB of rendered prompts kept for calls that repeat or extend one, such "
        "as a GRPO group's first calls (default 256; 0 turns the cache off)",
        convert=_number(int, "--render-cache-mib"),
        metavar="N",
    ),
    Flag(
        "--chat-template-kwargs",
        "chat_template_kwargs",
        "token mode: JSON object passed to the chat template (default: none)",
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
        "token mode: context length used to clamp max_tokens and refuse long prompts "
        "(default: no limit)",
        convert=_number(int, "--max-model-len"),
        metavar="N",
    ),
    Flag(
        "--sampling-overrides",
        "sampling_overrides",
        "token mode: JSON object of sampling parameters imposed on every call (default: none)",
        convert=_json_object("--sampling-overrides"),
        metavar="JSON",
    ),
    Flag(
        "--sampling-mask",
        "sampling_mask",
        "token mode: ask for sampling masks (default off)",
        convert=None,
    ),
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
        "token mode: reply with the completion's raw decoded text (default off: parsed)",
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
        "--engine-wire",
        "engine",
        "token mode: the engine's wire: vllm (its /inference/v1/generate), or MODULE:CLASS "
        "naming an engine wire class built with no arguments (default vllm; docs/tokens.md)",
        convert=load_wire,
        metavar="vllm|MODULE:CLASS",
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
        "record directory (skycap serve: default ./records, --no-record-dir keeps records in "
        "memory only; mitmdump and CaptureService: none, memory only)",
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
        "killed server; costs a disk flush per call; default off)",
        convert=None,
    ),
    Flag(
        "--record-mirror",
        "record_mirror",
        "also copy every record, in the background, to this fsspec URL (s3://bucket/prefix, "
        "gs://..., file:///...); needs the remote extra and --record-dir (default: none)",
        metavar="URL",
    ),
    Flag(
        "--record-mirror-config",
        "record_mirror_config",
        "JSON object: exclude, workers, queue_size, timeout, attempts, backoff, "
        "shutdown_timeout, storage_options (passed to fsspec; default: none)",
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
        "custom path rule, repeatable; without NAME= it is named by its import path "
        "(default: only the built-in rules)",
        convert=_path_rules,
        metavar="[NAME=]MODULE:FUNCTION",
        repeat=True,
    ),
    Flag(
        "--require-api-key",
        "require_api_key",
        "require each trajectory's api_key on the harness routes (default off)",
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
        "--keepalive",
        "keepalive",
        "seconds of silence in a streamed token-mode reply after which a keep-alive is sent "
        "(an Anthropic ping, a Responses keepalive event, an SSE comment for Chat "
        "Completions; default 15)",
        convert=_number(float, "--keepalive"),
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
        "--upstream-weight-versions",
        "upstream_weight_versions",
        "text mode: ask a vLLM upstream which weight versions sampled each reply (adds "
        "return_weight_versions to Chat Completions bodies; an upstream that refuses unknown "
        "fields, like OpenAI's, answers 400; default off)",
        convert=None,
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
        "named by the proxy credentials that POST /trajectories returns (default: off)",
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
        "--proxy-allow; default: none)",
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
        "and finish trajectories (a warning at start; default off)",
        convert=None,
    ),
)

FLAG_OF = {f.keyword: f.flag for f in FLAGS}
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

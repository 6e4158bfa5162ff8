"""Server options, the flag tables, keys, the retry cache and routing, without sockets."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from skycap.server import flags as flags_module
from skycap.server import options as options_module
from skycap.server.addon import (
    CHAT,
    COUNT_TOKENS,
    CREATE,
    DOCUMENT,
    FINISH,
    HARNESS_MISS,
    MESSAGES,
    MISS,
    MODELS,
    RESPONSE_GET,
    route,
)
from skycap.server.flags import FLAGS
from skycap.server.keys import KEY_PREFIX, authorized, new_api_key
from skycap.server.options import ServerOptions, from_values
from skycap.server.retry import CAPACITY, REUSED_KEY, Conflict, Replay, RetryCache, call_key

UP = "http://127.0.0.1:9/v1"


def rows_of_first_leaf(graph):
    """A custom path rule used by the option tests (imported by name)."""
    return [(graph.path_to(graph.leaves()[0]), [])]


def parse(*argv: str) -> ServerOptions:
    parser = argparse.ArgumentParser()
    flags_module.add_arguments(parser)
    return from_values(vars(parser.parse_args(list(argv))))


def test_defaults_follow_the_decisions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = ServerOptions(UP)
    assert options.host == "127.0.0.1"  # control routes are unauthenticated: loopback by default
    assert options.max_body_size == 1 << 30  # 1 GiB
    assert options.upstream_timeout is None  # no timeout unless asked for
    assert options.sweep_interval == 60.0 and options.ttl == 3600.0
    assert options.upstream_origin == ("http", "127.0.0.1", 9)
    assert options.upstream_path == "/v1"
    monkeypatch.chdir(tmp_path)
    relative = ServerOptions(UP, record_dir="rec")
    assert relative.record_dir == tmp_path / "rec" and relative.record_dir.is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"record_dir \(--record-dir\) .* cannot be created"):
        ServerOptions(UP, record_dir=tmp_path / "file" / "sub")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "images"}, "mode (--mode) must be one of text, tokens"),
        ({"mode": "tokens"}, "exactly one of tokenizer (--tokenizer) or renderer="),
        ({"renderer": "qwen3"}, "renderer_name (--renderer)"),
        ({"ttl": 0}, "ttl (--ttl) must be a positive number"),
        ({"upstream_timeout": -1.0}, "upstream_timeout (--upstream-timeout)"),
        ({"max_body_size": 0}, "max_body_size (--max-body-size) must be >= 1"),
        ({"port": 70000}, "port (--port) must be between 0 and 65535"),
        (
            {"sampling_overrides": [1]},
            "sampling_overrides (--sampling-overrides) must be a mapping",
        ),
        ({"keep_unrecorded": False, "record_dir": "."}, "is for a server with no record_dir"),
        ({"path_rules": {"all": "m:f"}}, "is built in"),
        ({"path_rules": {"mine": "no.such.module:f"}}, "cannot import module"),
    ],
)
def test_invalid_options_are_refused_before_start(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServerOptions(UP, **kwargs)


def test_upstream_url_is_required_and_checked() -> None:
    with pytest.raises(ValueError, match="upstream_url .* is required"):
        ServerOptions()
    with pytest.raises(ValueError, match="must be an http:// or https:// URL"):
        ServerOptions("engine:8000")
    with pytest.raises(TypeError):
        ServerOptions(UP, no_such_option=1)


@pytest.mark.parametrize("url", ["http://engine:8000/v1", "http://engine:8000/router/v1/"])
def test_token_mode_refuses_an_upstream_url_ending_in_v1(url: str) -> None:
    message = (
        f"upstream_url (--upstream-url) '{url}' ends in /v1, but token mode wants the engine "
        "root, e.g. http://engine:8000, not .../v1: drop the /v1"
    )
    with pytest.raises(ValueError) as refused:
        ServerOptions(url, mode="tokens", tokenizer="Qwen/Qwen3-8B")
    assert str(refused.value) == message
    with pytest.raises(ValueError, match="--upstream-url"):
        parse("--upstream-url", url, "--mode", "tokens", "--tokenizer", "Qwen/Qwen3-8B")
    assert ServerOptions(url).upstream_path.endswith("/v1")  # text mode wants the /v1
    root = ServerOptions("http://engine:8000/router", mode="tokens", tokenizer="Qwen/Qwen3-8B")
    assert root.upstream_path == "/router"


def test_every_flag_sets_a_real_keyword() -> None:
    fields = set(ServerOptions.__dataclass_fields__)
    assert {flag.keyword for flag in FLAGS} <= fields
    assert len({flag.flag for flag in FLAGS}) == len(FLAGS)
    # The docstring table names every flag, so docs and parser cannot drift apart.
    for flag in FLAGS:
        assert f"`{flag.flag}" in flags_module.__doc__


def test_cli_flags_build_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "sk-upstream")
    options = parse(
        "--upstream-url",
        UP,
        "--upstream-api-key-env",
        "MY_KEY",
        "--ttl",
        "12.5",
        "--require-api-key",
        "--max-body-size",
        "2048",
        "--upstream-timeout",
        "3",
        "--path-rule",
        f"first={__name__}:rows_of_first_leaf",
        "--path-rule",
        f"{__name__}:rows_of_first_leaf",
    )
    assert options.api_key == "sk-upstream"
    assert options.ttl == 12.5 and options.require_api_key and options.max_body_size == 2048
    assert options.upstream_timeout == 3.0
    assert options.port == 8080  # the CLI default; the keyword default is 0
    assert set(options.rules) == {"first", f"{__name__}:rows_of_first_leaf"}


def test_cli_errors_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--ttl must be a number, got 'soon'"):
        parse("--upstream-url", UP, "--ttl", "soon")
    with pytest.raises(ValueError, match="--mode tokens needs --tokenizer"):
        parse("--upstream-url", UP, "--mode", "tokens")
    with pytest.raises(ValueError, match="--sampling-overrides must be a JSON object"):
        parse("--upstream-url", UP, "--sampling-overrides", "[1]")
    with pytest.raises(ValueError, match="given twice"):
        parse("--upstream-url", UP, "--path-rule", "a=m:f", "--path-rule", "a=m:g")


def test_mitmdump_options_mirror_the_flags() -> None:
    from mitmproxy import optmanager

    manager = optmanager.OptManager()
    options_module.add_addon_options(manager)
    manager.update(
        skycap_upstream_url=UP, skycap_ttl="30", skycap_require_api_key=True, skycap_path_rule=[]
    )
    options = options_module.from_addon_options(manager)
    assert options.upstream_url == UP and options.ttl == 30.0 and options.require_api_key
    assert options.port == 0  # listening belongs to mitmproxy under mitmdump
    assert not hasattr(manager, "skycap_host")


def test_api_keys_are_compared_in_constant_time_as_bytes() -> None:
    key = new_api_key()
    assert key.startswith(KEY_PREFIX) and len(key) == len(KEY_PREFIX) + 32
    raw = key.encode()
    assert authorized(b"Bearer " + raw, raw)
    assert authorized(b"bEaReR\t " + raw + b"  ", raw)
    assert not authorized(None, raw)
    assert not authorized(raw, raw)  # no scheme
    assert not authorized(b"Basic " + raw, raw)
    assert not authorized(b"Bearer " + new_api_key().encode(), raw)
    assert not authorized("Bearer sk-skycap-é".encode() + b"\xff", raw)


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/t/tr_0123456789abcdef/v1/chat/completions", (CHAT, "tr_0123456789abcdef")),
        ("GET", "/t/tr_0123456789abcdef/v1/models?x=1", (MODELS, "tr_0123456789abcdef")),
        ("GET", "/t/tr_0123456789abcdef/v1/chat/completions", (HARNESS_MISS, None)),
        ("POST", "/t/../tr_0123456789abcdef/v1/chat/completions", (HARNESS_MISS, None)),
        ("POST", "/trajectories", (CREATE, None)),
        ("POST", "/trajectories/tr_x/finish", (FINISH, "tr_x")),
        ("GET", "/trajectories/tr_x", (DOCUMENT, "tr_x")),
        ("DELETE", "/trajectories/tr_x", (MISS, None)),
        ("POST", "/v1/chat/completions", (MISS, None)),
        ("POST", "/t/tr_0123456789abcdef/v1/messages?beta=true", (MESSAGES, "tr_0123456789abcdef")),
        (
            "POST",
            "/t/tr_0123456789abcdef/v1/messages/count_tokens",
            (COUNT_TOKENS, "tr_0123456789abcdef"),
        ),
        ("GET", "/t/tr_0123456789abcdef/v1/responses/r_1", (RESPONSE_GET, "tr_0123456789abcdef")),
        ("GET", "/metrics", (MISS, None)),
    ],
)
def test_routes_match_exactly(method: str, path: str, expected: tuple) -> None:
    assert route(method, path) == expected


def test_retry_key_rules() -> None:
    assert not call_key(b"{}", None, None).dedup
    assert not call_key(b"{}", "0", None).dedup
    assert not call_key(b"{}", "soon", None).dedup
    assert call_key(b"{}", "2", None).dedup
    keyed = call_key(b"{}", None, "abc")
    assert keyed.dedup and keyed.key == "key:abc"
    assert call_key(b"{}", "1", None).key == "body:" + keyed.digest


async def test_retry_cache_replays_coalesces_and_shares_a_replacement() -> None:
    cache = RetryCache()
    key = call_key(b'{"a": 1}', "1", None)
    first = cache.register(key)
    waiter = asyncio.ensure_future(cache.lookup(key))
    await asyncio.sleep(0)
    replay = Replay.of(200, [(b"content-type", b"application/json"), (b"date", b"x")], b"{}")
    first.settle(replay)
    found = await waiter
    assert (
        found is not None
        and found.coalesced
        and found.replay.headers == ((b"content-type", b"application/json"),)
    )
    # A failed original: the first retry to look becomes the new call; a second one waits on it.
    failed = cache.register(key)
    failed.settle(None)
    assert await cache.lookup(key) is None
    replacement = cache.register(key)
    second = asyncio.ensure_future(cache.lookup(key))
    await asyncio.sleep(0)
    assert not second.done()
    replacement.settle(replay)
    assert (await second).replay is replay
    cache.register(call_key(b"one", None, "same"))
    with pytest.raises(Conflict, match=REUSED_KEY):
        await cache.lookup(call_key(b"two", None, "same"))


async def test_retry_cache_evicts_only_settled_entries() -> None:
    cache = RetryCache()
    running = [cache.register(call_key(b"%d" % i, None, None)) for i in range(CAPACITY)]
    cache.register(call_key(b"extra", None, None))
    assert len(cache) == CAPACITY + 1  # nothing settled, nothing evicted
    for entry in running[:3]:
        entry.settle(Replay.of(200, [], b"{}"))
    cache.register(call_key(b"more", None, None))
    assert len(cache) == CAPACITY
    # The oldest settled entries were evicted (their retries run again); the next one replays.
    assert await cache.lookup(call_key(b"1", "1", None)) is None
    assert await cache.lookup(call_key(b"2", "1", None)) is not None

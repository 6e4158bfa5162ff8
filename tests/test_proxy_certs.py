"""The proxy's CA (created once, owner-only key, bundle), `skycap ca`, and the proxy options."""

from __future__ import annotations

import argparse
import concurrent.futures
import stat
from pathlib import Path

import certifi
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from mitmproxy import optmanager

from skycap.certs import default_confdir, ensure_ca
from skycap.cli.main import main
from skycap.server import flags as flags_module
from skycap.server import options as options_module
from skycap.server.addon import (
    CHAT,
    COUNT_TOKENS,
    MESSAGES,
    MODELS,
    PASS,
    REFUSED,
    RESPONSE_GET,
    RESPONSES,
    proxy_route,
)
from skycap.server.keys import basic_credentials
from skycap.server.options import ServerOptions, from_values

UP = "http://127.0.0.1:9/v1"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _ca_pem(key_file: Path) -> bytes:
    return x509.load_pem_x509_certificates(key_file.read_bytes())[0].public_bytes(
        serialization.Encoding.PEM
    )


def test_the_ca_is_created_once_owner_only_and_bundled(tmp_path: Path) -> None:
    confdir = tmp_path / "conf"
    ca = ensure_ca(confdir)
    assert _mode(ca.key_file) == 0o600 and _mode(confdir) == 0o700
    assert b"PRIVATE KEY" in ca.key_file.read_bytes()
    assert b"PRIVATE KEY" not in ca.bundle.read_bytes()
    bundle = ca.bundle.read_bytes()
    cert = _ca_pem(ca.key_file)
    assert bundle.startswith(Path(certifi.where()).read_bytes().rstrip(b"\n"))
    assert bundle.endswith(cert) and ca.cert_file.read_bytes() == cert
    subject = x509.load_pem_x509_certificate(cert).subject.rfc4514_string()
    assert "skycap" in subject
    key_before = ca.key_file.read_bytes()
    ca.bundle.write_bytes(b"stale")
    again = ensure_ca(confdir)
    assert again == ca and ca.key_file.read_bytes() == key_before
    assert ca.bundle.read_bytes() == bundle  # a stale bundle is rewritten


def test_concurrent_starts_share_one_ca(tmp_path: Path) -> None:
    confdir = tmp_path / "race"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: ensure_ca(confdir), range(4)))
    certs = {_ca_pem(result.key_file) for result in results}
    assert len(certs) == 1
    leftovers = [p.name for p in confdir.iterdir() if p.name.startswith(".")]
    assert leftovers == [".skycap-ca.lock"]  # no temporary file is left behind


def test_a_key_readable_by_others_is_tightened(tmp_path: Path) -> None:
    ca = ensure_ca(tmp_path)
    ca.key_file.chmod(0o644)
    ensure_ca(tmp_path)
    assert _mode(ca.key_file) == 0o600


def test_default_confdir_is_the_users_config_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", "/somewhere/config")
    assert default_confdir() == Path("/somewhere/config/skycap")
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert default_confdir() == Path.home() / ".config" / "skycap"


def test_skycap_ca_prints_the_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ca", "--confdir", str(tmp_path / "c")]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == tmp_path / "c" / "skycap-ca-bundle.pem" and printed.is_file()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["ca", "--confdir", str(blocker / "c")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("skycap ca: error:") and str(blocker / "c") in err


def test_proxy_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    options = ServerOptions(proxy_port=0)  # text mode behind the proxy needs no upstream
    assert options.upstream_url is None and options.confdir == tmp_path / "skycap"
    assert ServerOptions(UP).confdir is None and ServerOptions(UP).proxy_port is None
    with pytest.raises(ValueError, match=r"upstream_url \(--upstream-url\) is required"):
        ServerOptions()
    with pytest.raises(ValueError, match="upstream_url"):
        ServerOptions(mode="tokens", tokenizer="x", proxy_port=0)
    with pytest.raises(ValueError, match=r"proxy_port \(--proxy-port\) must be between 0"):
        ServerOptions(UP, proxy_port=70000)
    with pytest.raises(ValueError, match="must differ from port"):
        ServerOptions(UP, port=8080, proxy_port=8080)
    parser = argparse.ArgumentParser()
    flags_module.add_arguments(parser)
    parsed = from_values(
        vars(parser.parse_args(["--proxy-port", "8081", "--confdir", str(tmp_path / "c")]))
    )
    assert parsed.proxy_port == 8081 and parsed.confdir == tmp_path / "c"
    with pytest.raises(ValueError, match="--proxy-port must be an integer"):
        from_values(vars(parser.parse_args(["--proxy-port", "x"])))


def test_mitmdump_turns_the_proxy_on_with_a_regular_mode(tmp_path: Path) -> None:
    from mitmproxy.options import Options

    opts = Options()
    options_module.add_addon_options(opts)
    opts.update(mode=["reverse:http://127.0.0.1:9", "regular@8081"], confdir=str(tmp_path))
    built = options_module.from_addon_options(opts)
    assert built.proxy_port == 8081 and built.confdir == tmp_path and built.upstream_url is None
    manager = optmanager.OptManager()  # no mitmproxy options at all: proxy off
    options_module.add_addon_options(manager)
    manager.update(skycap_upstream_url=UP)
    assert options_module.from_addon_options(manager).proxy_port is None


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/openai/deployments/gpt/chat/completions?api-version=2024", CHAT),
        ("GET", "/v1/models", MODELS),
        ("GET", "/v1/models/gpt-4o", PASS),
        ("GET", "/v1/chat/completions", PASS),
        ("POST", "/v1/embeddings", PASS),
        ("POST", "/v1/messages?beta=true", MESSAGES),
        ("POST", "/v1/messages/count_tokens?beta=true", COUNT_TOKENS),
        ("POST", "/v1/responses", RESPONSES),
        ("GET", "/v1/responses/resp_1", RESPONSE_GET),
    ],
)
def test_what_the_proxy_captures(method: str, path: str, kind: str) -> None:
    assert proxy_route(method, path) == kind  # captured routes of an HTTPS_PROXY trajectory
    refused = REFUSED if kind == PASS else kind
    # model-API hosts: uncaptured routes refused
    assert proxy_route(method, path, model_api_host=True) == refused


def test_basic_credentials_parse_strictly() -> None:
    assert basic_credentials(b"Basic dHJfeDpzay0xOjI=") == (b"tr_x", b"sk-1:2")
    assert basic_credentials(b"basic\t dHJfeDpr ") == (b"tr_x", b"k")
    assert basic_credentials(b"Bearer dHJfeDpr") is None
    assert basic_credentials(b"Basic not-base64!") is None
    assert basic_credentials(b"Basic dHJfeA==") is None  # no colon
    assert basic_credentials(b"Basic") is None

"""skycap's own certificate authority for the HTTPS_PROXY mode: created once per confdir.

The proxy decrypts a harness's HTTPS by signing a certificate for each host with this CA;
the harness trusts it through `SSL_CERT_FILE=<bundle>`, where the bundle is certifi's
roots plus the CA certificate (`SSL_CERT_FILE` replaces the default roots, so the bundle
must carry both). mitmproxy's `tlsconfig` addon reads the CA from `<confdir>/mitmproxy-ca.pem`,
so the files keep mitmproxy's names and a confdir mitmproxy created is reused as is.

mitmproxy's own `CertStore.create_store` is neither locked nor thread-safe (it flips the
process umask), so the CA is created here: under an exclusive lock on the confdir, with
the key file opened 0600 from the start and every file written atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("skycap.certs")

KEY_FILE = "mitmproxy-ca.pem"  # key + certificate; the name mitmproxy's tlsconfig reads
CERT_FILE = "mitmproxy-ca-cert.pem"
DHPARAM_FILE = "mitmproxy-dhparam.pem"
BUNDLE_FILE = "skycap-ca-bundle.pem"
LOCK_FILE = ".skycap-ca.lock"
CA_ORGANIZATION = "skycap"
CA_COMMON_NAME = "skycap capture proxy CA"
KEY_SIZE = 2048


@dataclass(frozen=True)
class CertAuthority:
    """Where a confdir's CA lives; `bundle` is what a harness's `SSL_CERT_FILE` points to."""

    confdir: Path
    key_file: Path
    cert_file: Path
    bundle: Path


def default_confdir() -> Path:
    """`$XDG_CONFIG_HOME/skycap`, else `~/.config/skycap` (the CA is per user, never per repo)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser().absolute() / "skycap"


def ensure_ca(confdir: str | Path | None = None) -> CertAuthority:
    """Create the CA in `confdir` if it has none, and (re)write the bundle if it is stale.

    Safe to call from concurrent processes: the work runs under an exclusive lock, so
    every caller ends up with the same CA. Raises OSError naming the path on failure.
    """
    directory = Path(confdir).expanduser().absolute() if confdir else default_confdir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(
            f"the skycap confdir {str(directory)!r} cannot be created: {exc.strerror or exc}; "
            "pass another one with --confdir"
        ) from None
    ca = CertAuthority(
        confdir=directory,
        key_file=directory / KEY_FILE,
        cert_file=directory / CERT_FILE,
        bundle=directory / BUNDLE_FILE,
    )
    with _locked(directory / LOCK_FILE):
        if not ca.key_file.exists():
            _create(ca)
        _tighten(ca.key_file)
        _write_bundle(ca)
    return ca


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _create(ca: CertAuthority) -> None:
    from cryptography.hazmat.primitives import serialization
    from mitmproxy.certs import DEFAULT_DHPARAM, create_ca

    key, cert = create_ca(organization=CA_ORGANIZATION, cn=CA_COMMON_NAME, key_size=KEY_SIZE)
    pem_key = key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.TraditionalOpenSSL,
        encryption_algorithm=serialization.NoEncryption(),
    )
    pem_cert = cert.public_bytes(serialization.Encoding.PEM)
    # The dhparam and certificate files first: the key file's existence means "complete".
    _atomic_write(ca.confdir / DHPARAM_FILE, DEFAULT_DHPARAM, 0o644)
    _atomic_write(ca.cert_file, pem_cert, 0o644)
    _atomic_write(ca.key_file, pem_key + pem_cert, 0o600)
    logger.info("created the skycap CA in %s", ca.confdir)


def _tighten(key_file: Path) -> None:
    """A key readable by others (a hand-copied confdir) is made owner-only, with a warning."""
    mode = stat.S_IMODE(key_file.stat().st_mode)
    if mode & 0o077:
        key_file.chmod(0o600)
        logger.warning("%s was readable by others (mode %o); it is now 0600", key_file, mode)


def _ca_certificate(key_file: Path) -> bytes:
    """The CA certificate in the key file, the one mitmproxy signs with (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    certificates = x509.load_pem_x509_certificates(key_file.read_bytes())
    return certificates[0].public_bytes(serialization.Encoding.PEM)


def _write_bundle(ca: CertAuthority) -> None:
    import certifi

    roots = Path(certifi.where()).read_bytes()
    wanted = roots.rstrip(b"\n") + b"\n\n# skycap capture proxy CA\n" + _ca_certificate(ca.key_file)
    with contextlib.suppress(FileNotFoundError):
        if ca.bundle.read_bytes() == wanted:
            return
    _atomic_write(ca.bundle, wanted, 0o644)


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    """Write beside `path` with `mode` from the first byte, then rename over it."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise

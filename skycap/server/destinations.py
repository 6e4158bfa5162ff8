"""Where the proxy listener's pass-through may go: not this machine, unless allowed.

A harness's traffic that is not a model call passes through the proxy to its destination.
Without limits that makes skycap a relay into the services of its own machine, so a
destination whose resolved address is loopback, link-local (169.254.0.0/16 holds cloud
metadata endpoints) or unspecified is refused. Private ranges pass: cluster package
mirrors and model servers live there. `--proxy-allow HOST|CIDR[:PORT]` widens that,
`--proxy-deny` narrows it; a deny wins over an allow.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Rule:
    """One `--proxy-allow` / `--proxy-deny` value: a host name or a network, maybe a port."""

    spec: str
    network: Network | None
    host: str | None
    port: int | None

    def matches(self, host: str, port: int, addresses: list[Address]) -> bool:
        if self.port is not None and port != self.port:
            return False
        if self.network is not None:
            return any(address in self.network for address in addresses)
        assert self.host is not None
        name = host.lower().rstrip(".")
        if self.host.startswith("*."):
            return name.endswith(self.host[1:])
        return name == self.host


def parse_rule(spec: str, flag: str) -> Rule:
    """`HOST`, `CIDR`, `HOST:PORT`, `CIDR:PORT` or `[IPv6]:PORT`; ValueError names `flag`."""
    text = spec.strip()
    port: int | None = None
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{flag} {spec!r}: write an IPv6 address with a port as [ADDR]:PORT")
        text, port_text = inside, rest[1:]
        port = _port(port_text, spec, flag) if rest else None
    elif text.count(":") == 1:
        text, _, port_text = text.partition(":")
        port = _port(port_text, spec, flag)
    if not text:
        raise ValueError(f"{flag} {spec!r}: name a host, an address or a network (CIDR)")
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        if "/" in text or not all(part for part in text.removeprefix("*.").split(".")):
            raise ValueError(
                f"{flag} {spec!r}: not a host name or a network (e.g. 10.0.0.0/8, "
                "mirror.internal, *.example.com, 127.0.0.1:3128)"
            ) from None
        return Rule(spec, None, text.lower().rstrip("."), port)
    return Rule(spec, network, None, port)


def _port(text: str, spec: str, flag: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{flag} {spec!r}: the port must be a number from 1 to 65535")
    return int(text)


def _unwrap(address: Address) -> Address:
    """An IPv4-mapped IPv6 address (`::ffff:127.0.0.1`) is judged as the IPv4 it carries."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def this_machine(address: Address) -> bool:
    """Loopback, link-local or unspecified: an address that reaches this host or its link."""
    address = _unwrap(address)
    return address.is_loopback or address.is_link_local or address.is_unspecified


class Destinations:
    """Judges pass-through destinations against the built-in refusal and the two lists."""

    def __init__(self, allow: list[Rule], deny: list[Rule]) -> None:
        self.allow = allow
        self.deny = deny

    async def refusal(self, host: str, port: int) -> str | None:
        """Why `host:port` may not be reached through the proxy, None when it may.

        Names resolve first (every address the name has must pass), so a name that points
        at 127.0.0.1 is refused like the address itself.
        """
        addresses = await _resolve(host, port)
        if addresses is None:
            return None  # unresolvable: the connection fails on its own, with mitmproxy's error
        where = f"{host}:{port}"
        for rule in self.deny:
            if rule.matches(host, port, addresses):
                return f"{where} is refused by --proxy-deny {rule.spec}"
        if any(rule.matches(host, port, addresses) for rule in self.allow):
            return None
        local = [str(a) for a in addresses if this_machine(a)]
        if local:
            resolved = "" if local == [host] else f" (resolves to {', '.join(local)})"
            return (
                f"{where}{resolved} is loopback or link-local, which the proxy does not pass "
                f"through; start skycap with --proxy-allow {host}:{port} to allow it"
            )
        return None


async def _resolve(host: str, port: int) -> list[Address] | None:
    try:
        return [_unwrap(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    addresses = []
    for info in infos:
        try:
            addresses.append(_unwrap(ipaddress.ip_address(str(info[4][0]).partition("%")[0])))
        except ValueError:
            continue
    return addresses or None

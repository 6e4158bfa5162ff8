"""Run a capture server: mitmproxy in-process on the current event loop with a lean addon set.

`serve()` is what `skycap serve` runs and what the embedded CaptureService runs on its
own thread's loop. It binds `options.host:options.port`, reports the bound URL through
`ready`, serves until `stop_event` is set, then closes the listening socket and lets the
addon write every trajectory still in memory (mitmproxy's `done` hook).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from mitmproxy import options as mitm_options
from mitmproxy.addons import core, dns_resolver, next_layer, proxyserver, tlsconfig
from mitmproxy.master import Master

from skycap.server.addon import SkycapAddon
from skycap.server.options import ServerOptions

logger = logging.getLogger("skycap.server")

# mitmproxy logs every connection at INFO, and httpcore builds DEBUG records per request
# (the cost is measured in docs/notes): keep them at WARNING unless skycap itself is at DEBUG.
CHATTY_LOGGERS = ("mitmproxy", "httpx", "httpcore", "hpack")


def quiet_third_party_loggers() -> None:
    """D-15: mitmproxy's and the HTTP clients' chatter stays below warning unless asked for."""
    wanted = logging.getLogger("skycap").getEffectiveLevel()
    level = wanted if wanted <= logging.DEBUG else logging.WARNING
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def lean_addons() -> list[object]:
    """The few mitmproxy addons a reverse proxy needs (dispatch to ~33 defaults costs ~45% CPU)."""
    return [
        core.Core(),
        proxyserver.Proxyserver(),
        next_layer.NextLayer(),
        tlsconfig.TlsConfig(),
        dns_resolver.DnsResolver(),
    ]


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Running:
    """Signals that mitmproxy's `running` hook fired (listeners bound, other addons started)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def running(self) -> None:
        self.event.set()


async def serve(
    options: ServerOptions,
    *,
    ready: Callable[[str], None] | None = None,
    stop_event: asyncio.Event | None = None,
    addons: Sequence[object] | None = None,
) -> None:
    """Serve until `stop_event` is set; `ready(url)` gets `http://host:port` once bound.

    `addons` replaces the skycap addon (the benchmark's no-op proxy uses it). Raises
    OSError when the address cannot be bound. One server per process: mitmproxy's
    context is global.
    """
    quiet_third_party_loggers()
    loop = asyncio.get_running_loop()
    opts = mitm_options.Options()
    master = Master(opts, event_loop=loop)
    signal = _Running()
    master.addons.add(*lean_addons(), *(addons or [SkycapAddon(options)]), signal)
    scheme, host, port = options.upstream_origin
    target = f"[{host}]" if ":" in host else host
    opts.update(
        mode=[f"reverse:{scheme}://{target}:{port}"],
        listen_host=options.host,
        listen_port=options.port,
        connection_strategy="lazy",
        keep_host_header=True,
    )
    run = loop.create_task(master.run())
    started = loop.create_task(signal.event.wait())
    await asyncio.wait([run, started], return_when=asyncio.FIRST_COMPLETED)
    if run.done():
        started.cancel()
        run.result()
        raise RuntimeError("mitmproxy stopped before it was running")
    server = master.addons.get("proxyserver")
    try:
        failures = [i.last_exception for i in server.servers if i.last_exception]
        if failures:
            raise OSError(f"cannot listen on {options.host}:{options.port}: {failures[0]}")
        bound_host, bound_port = server.listen_addrs()[0][:2]
        if ready is not None:
            ready(_url(bound_host, bound_port))
        await (stop_event or asyncio.Event()).wait()
    finally:
        await server.servers.update([])
        master.shutdown()
        await run
        await _close_connections(server)


async def _close_connections(server: proxyserver.Proxyserver, grace: float = 5.0) -> None:
    """Close the harness connections still open (keep-alive) so no handler outlives the loop."""
    for handler in list(server.connections.values()):
        transport = handler.transports.get(handler.client)
        if transport is not None and transport.handler is not None:
            transport.handler.cancel("skycap is shutting down")
    deadline = asyncio.get_running_loop().time() + grace
    while server.connections and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)

"""Run a capture server: mitmproxy in-process on the current event loop with a lean addon set.

`serve()` is what `skycap serve` runs and what the embedded CaptureService runs on its
own thread's loop. It binds `options.host:options.port` (the base-URL listener, served by
`frontdoor.FrontDoor` through the addon's hooks; what that loop does not speak goes on to
mitmproxy's reverse mode, which listens on 127.0.0.1 only), reports the bound URL through
`ready`, serves until `stop_event` is set, then closes the listening sockets and lets the
addon write every trajectory still in memory (mitmproxy's `done` hook). With
`options.proxy_port` it also listens as a regular (HTTPS_PROXY) proxy on that port, in the
same process, signing with the CA in `options.confdir` (the addon reports the bound port).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import Callable, Sequence

from mitmproxy import options as mitm_options
from mitmproxy.addons import core, dns_resolver, next_layer, proxyserver, tlsconfig
from mitmproxy.master import Master
from mitmproxy.proxy.mode_specs import ReverseMode

from skycap.logqueue import install_log_queue, uninstall_log_queue
from skycap.server.addon import SkycapAddon
from skycap.server.frontdoor import FrontDoor
from skycap.server.options import ServerOptions

logger = logging.getLogger("skycap.server")

# mitmproxy logs every connection at INFO, and httpcore builds DEBUG records per request
# (the cost is measured in docs/notes): keep them at WARNING unless skycap itself is at DEBUG.
CHATTY_LOGGERS = ("mitmproxy", "httpx", "httpcore", "hpack")
#: Where mitmproxy's reverse mode listens: it only takes the connections the front door
#: hands it, on their own sockets.
HANDOVER_HOST = "127.0.0.1"


def quiet_third_party_loggers() -> None:
    """Mitmproxy's and the HTTP clients' chatter stays below warning unless asked for."""
    wanted = logging.getLogger("skycap").getEffectiveLevel()
    level = wanted if wanted <= logging.DEBUG else logging.WARNING
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    proxyserver_log = logging.getLogger("mitmproxy.addons.proxyserver")
    if _drop_bind_errors not in proxyserver_log.filters:
        proxyserver_log.addFilter(_drop_bind_errors)


def _drop_bind_errors(record: logging.LogRecord) -> bool:
    """serve() reports a failed bind itself, with skycap's flags rather than mitmproxy's."""
    message = record.getMessage()
    return bool(message.strip()) and "failed to listen" not in message


def settle_garbage_collector() -> None:
    """Freeze start-up objects and collect young garbage less often.

    A server keeps long histories and many call records alive; with the default threshold
    the collector's work grows with them. `skycap serve` calls this once it is listening:
    it owns its process, while an embedding trainer keeps its own GC settings.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The loop a server runs on: uvloop's where it is installed, else asyncio's.

    Each call through the server runs a few dozen loop steps (reads, writes, hook tasks);
    uvloop's cost less than asyncio's pure-Python ones (docs/performance.md).
    """
    try:
        import uvloop
    except ImportError:  # not built for this platform (Windows): asyncio's own loop
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


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
    context is global. While it serves, its loggers write through skycap.logqueue, so a
    slow reader of stderr never stalls the loop.
    """
    quiet_third_party_loggers()
    install_log_queue()
    try:
        await _serve(options, ready, stop_event, addons)
    finally:
        uninstall_log_queue()


async def _serve(
    options: ServerOptions,
    ready: Callable[[str], None] | None,
    stop_event: asyncio.Event | None,
    addons: Sequence[object] | None,
) -> None:
    loop = asyncio.get_running_loop()
    opts = mitm_options.Options()
    if options.proxy_port is not None:
        opts.update(confdir=str(options.confdir))  # before tlsconfig first reads it
    master = Master(opts, event_loop=loop)
    signal = _Running()
    own = list(addons) if addons else [SkycapAddon(options)]  # the front door calls these
    master.addons.add(*lean_addons(), *own, signal)
    opts.update(
        mode=_modes(options),
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
    # Every hook of every flow visits each addon in the chain: the signal's job is done.
    master.addons.remove(signal)
    server = master.addons.get("proxyserver")
    front: FrontDoor | None = None
    try:
        for instance in server.servers:
            if instance.last_exception is not None:
                # mitmproxy appends advice about its own --mode flag: keep the first line.
                reason = str(instance.last_exception).splitlines()[0]
                if isinstance(instance.mode, ReverseMode):  # its port is the OS's choice
                    raise OSError(
                        f"mitmproxy's reverse listener cannot listen on {HANDOVER_HOST}: {reason}"
                    )
                raise OSError(
                    f"the proxy listener cannot listen on {options.host}:{options.proxy_port}: "
                    f"{reason}; pass another --proxy-port"
                )
        (reverse,) = [i for i in server.servers if isinstance(i.mode, ReverseMode)]
        front = FrontDoor(own, reverse.mode, _target(options), reverse.handle_stream)
        try:
            bound_host, bound_port = await front.start(options.host, options.port)
        except OSError as exc:
            raise OSError(
                f"the server cannot listen on {options.host}:{options.port}: "
                f"{exc.strerror or exc}; pass another --port"
            ) from None
        for addon in own:
            attach = getattr(addon, "attach_front_door", None)
            if attach is not None:
                attach(front, bound_port)
        if ready is not None:
            ready(_url(bound_host, bound_port))
        # Only now has the caller published what a client needs (the control token file).
        for addon in own:
            started = getattr(addon, "started", None)
            if started is not None:
                started()
        await (stop_event or asyncio.Event()).wait()
    finally:
        if front is not None:
            front.stop_listening()
        await server.servers.update([])
        # Trajectories close to calls, then keep-alive connections close, and only
        # then (mitmproxy's `done` hook) are records written: nothing answered is missed.
        for addon in own:
            close = getattr(addon, "close_to_calls", None)
            if close is not None:
                close()
        if front is not None:
            await front.close(grace=5.0)
        await _close_connections(server)
        master.shutdown()
        await run
        await _close_connections(server)


def _target(options: ServerOptions) -> tuple[str, str, int]:
    """(scheme, host, port) a base-URL request names before the addon re-targets it."""
    if options.upstream_url:
        return options.upstream_origin
    return "http", "127.0.0.1", 9


def _modes(options: ServerOptions) -> list[str]:
    """mitmproxy's reverse mode (the connections the front door hands it), plus the proxy
    listener if asked."""
    scheme, host, port = _target(options)
    target = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
    modes = [f"reverse:{target}@{HANDOVER_HOST}:0"]
    if options.proxy_port is not None:
        proxy_port = options.proxy_port
        if proxy_port == 0:
            proxy_port = _free_port(options.host)
        modes.append(f"regular@{options.host}:{proxy_port}")
    return modes


def _free_port(host: str) -> int:
    """A port the OS hands out now, for the proxy when both listeners ask for port 0.

    mitmproxy refuses two modes on one (host, port) spec, `0` included, so one of them
    must name its port; the window until mitmproxy binds it is a few milliseconds.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


async def _close_connections(server: proxyserver.Proxyserver, grace: float = 5.0) -> None:
    """Close the harness connections still open (keep-alive) so no handler outlives the loop."""
    for handler in list(server.connections.values()):
        transport = handler.transports.get(handler.client)
        if transport is not None and transport.handler is not None:
            transport.handler.cancel("skycap is shutting down")
    deadline = asyncio.get_running_loop().time() + grace
    while server.connections and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)

"""CaptureService: a capture server embedded in the caller's process, on its own thread and loop.

A trainer that creates a new event loop per batch is unaffected: the server runs on a
daemon thread named `skycap` with a loop of its own. It is built from the same
`ServerOptions` as `skycap serve`. mitmproxy's context is process-global, so only
one service may run per process at a time; stop it, then another may start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

import skycap.control_token as credential

if TYPE_CHECKING:
    from skycap.client import CapturePool

logger = logging.getLogger("skycap.service")

DEFAULT_START_TIMEOUT = 60.0


class RecordsLost(RuntimeError):
    """`stop()` could not write these trajectories' records; `ids` names them.

    Their crash journals stay in `<record dir>/.journal`, so the next server started on
    the same record directory rebuilds them.
    """

    def __init__(self, ids: list[str], record_dir: object) -> None:
        self.ids = list(ids)
        super().__init__(
            f"{len(self.ids)} records could not be written to {record_dir}: "
            f"{', '.join(self.ids)}; their crash journals stay for the next start"
        )


def _format_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class CaptureService:
    """Run one capture server in this process; `start()` returns its URL, `stop()` writes records.

    `upstream_url` may be positional; every other option is a keyword of
    `skycap.server.options.ServerOptions` (an unknown keyword raises TypeError, an invalid
    combination ValueError, before anything starts).

    `record_dir=None` (the default) keeps every record in memory only: nothing is written,
    nothing expires, and what was not finished is gone when the process ends. Pass a
    directory to keep records (`skycap serve` defaults to `./records`).
    """

    _running: ClassVar[CaptureService | None] = None
    _running_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, upstream_url: str | None = None, **options: Any) -> None:
        from skycap.server.options import ServerOptions

        self.options = ServerOptions(upstream_url, **options)
        self.url: str | None = None
        self.harness_url: str | None = None
        self.exposed_url: str | None = None
        self.server: Any = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self, timeout: float | None = None) -> str:
        """Launch the thread and wait until the listener is bound; return the control URL."""
        if timeout is None:
            timeout = float(os.environ.get("SKYCAP_START_TIMEOUT", DEFAULT_START_TIMEOUT))
        with CaptureService._running_lock:
            if self._thread is not None:
                raise RuntimeError("this CaptureService was already started; create a new one")
            if CaptureService._running is not None:
                raise RuntimeError(
                    "another CaptureService is running in this process (mitmproxy allows one "
                    f"per process, at {CaptureService._running.url}); stop() it first"
                )
            CaptureService._running = self
        try:
            from skycap.server.addon import SkycapAddon

            self.server = SkycapAddon(self.options)
        except BaseException:  # e.g. a tokenizer that cannot load: free the process slot
            self._release_slot()
            raise
        from skycap.server.runner import new_event_loop

        self._loop = new_event_loop()
        self._stop_event = asyncio.Event()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name="skycap", daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout):
            self.stop()
            raise TimeoutError(f"skycap did not start within {timeout:g} s")
        if self.url is None:
            self.stop()
            raise RuntimeError("skycap failed to start") from self._error
        return self.url

    def _main(self, ready: threading.Event) -> None:
        from skycap.server.runner import serve

        def on_ready(bound: str) -> None:
            port = urlsplit(bound).port
            assert port is not None
            self.server.publish_token(port, default=False)  # only to a file it was given
            self.url = _format_url(self.options.advertise_host, port)
            self.harness_url = self.url
            if self.control_token is not None:
                credential.register(self.url, self.control_token)
            ready.set()

        assert self._loop is not None and self._stop_event is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(
                serve(
                    self.options,
                    ready=on_ready,
                    stop_event=self._stop_event,
                    addons=[self.server],
                )
            )
        except BaseException as exc:  # reported by start(); the thread must not die loudly
            self._error = exc
            logger.debug("capture server stopped with an error", exc_info=True)
        finally:
            if self.url is not None:
                credential.unregister(self.url)
            self._loop.close()
            ready.set()
            self._release_slot()

    def _release_slot(self) -> None:
        with CaptureService._running_lock:
            if CaptureService._running is self:
                CaptureService._running = None

    @property
    def control_token(self) -> str | None:
        """The token control routes require, kept in memory; None when turned off.

        A `CapturePool([service.url])` in this process finds it by URL; `pool()` hands over
        a pool that already holds it.
        """
        return self.options.control_token

    def pool(self, **kwargs: Any) -> CapturePool:
        """A CapturePool over this server that sends its control token (keywords go to it)."""
        if self.url is None:
            raise RuntimeError("this CaptureService is not running: call start() first")
        from skycap.client import CapturePool

        return CapturePool([self.url], control_token=self.control_token, **kwargs)

    @property
    def proxy_url(self) -> str | None:
        """The HTTPS_PROXY listener (`proxy_port`), without credentials; None when it is off.

        Each trajectory's own credentialed URL and harness `env` come with its create.
        """
        proxy = getattr(self.server, "proxy", None)
        if proxy is None or not proxy.port:
            return None
        return _format_url(self.options.advertise_host, proxy.port)

    def run_in_loop[T](self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run `fn()` on the server's event loop and return its result (or raise its error).

        The running server's state (`server.store` and the live trajectories in it) belongs
        to that loop: read or change it through here, never from another thread.
        """
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive() or self.url is None:
            raise RuntimeError(
                "this CaptureService is not running: call run_in_loop between start() and stop()"
            )

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout)

    def stop(self, timeout: float = 120.0) -> bool:
        """Shut down gracefully (records written) and join the thread; idempotent.

        Returns False, with a warning, if the thread did not finish within `timeout`.
        Raises RecordsLost when records could not be written (the disk is full, say).
        """
        thread, loop, stop_event = self._thread, self._loop, self._stop_event
        if thread is None or loop is None or stop_event is None:
            return True
        if thread.is_alive():
            try:
                loop.call_soon_threadsafe(stop_event.set)
            except RuntimeError:  # the loop already closed: the thread is finishing
                pass
            thread.join(timeout)
        if thread.is_alive():
            logger.warning("skycap did not stop within %g s; records may be incomplete", timeout)
            return False
        store = getattr(self.server, "store", None)
        lost = store.lost if store is not None else []
        if lost:
            store.lost = []  # reported once: stop() is idempotent
            raise RecordsLost(lost, self.options.record_dir)
        return True

    def __enter__(self) -> CaptureService:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

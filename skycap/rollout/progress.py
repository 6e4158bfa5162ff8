"""A progress bar for a batch of rollouts on the terminal (rich); silent when not a terminal."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class BatchProgress:
    """Counts finished rollouts, retries and failures; draws only on a terminal (stderr).

    `enabled=None` decides by the terminal, so logs and CI output stay clean.
    """

    def __init__(self, description: str, total: int, enabled: bool | None = None) -> None:
        console = Console(stderr=True)
        show = console.is_terminal if enabled is None else enabled
        self.retries = 0
        self.failed = 0
        self._progress: Progress | None = None
        self._task = None
        if show and total > 0:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self._task = self._progress.add_task(description, total=total, detail="")

    def __enter__(self) -> BatchProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def retried(self) -> None:
        self.retries += 1
        self._refresh(advance=0)

    def done(self, ok: bool) -> None:
        if not ok:
            self.failed += 1
        self._refresh(advance=1)

    def _refresh(self, advance: int) -> None:
        if self._progress is None or self._task is None:
            return
        detail = (
            f"{self.retries} retried, {self.failed} failed" if self.retries or self.failed else ""
        )
        self._progress.update(self._task, advance=advance, detail=detail)

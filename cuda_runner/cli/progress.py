"""Progress on a terminal: a command's own task, and the weights of a load that takes a while.

One rich display serves both (rich allows one live display at a time). The
command's task (input sets, measuring) shows from the start when there is
one; a load's bar appears only once the load has taken LOAD_BAR_AFTER_S, so
that quick loads print nothing, and goes when the load is done.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any

LOAD_BAR_AFTER_S = 1.0


class TerminalProgress:
    """`advance(done, total)` for the command's task, `load(method, done, total)` for weight bytes."""

    def __init__(self, stream: Any, label: str | None):
        self._stream = stream
        self._label = label
        self._progress: Any = None
        self._task: Any = None
        self._lock = threading.Lock()
        self._load: dict[str, Any] = {}  # method -> its bar's task, once shown
        self._latest: dict[str, tuple[int, int]] = {}  # method -> (done, total) last heard
        self._timers: dict[str, threading.Timer] = {}
        self._started: dict[str, float] = {}  # method -> when its load was first heard of
        self._closed = False  # after the with block: nothing is shown any more

    def __enter__(self) -> TerminalProgress:
        if self._label is not None:
            self._task = self._display().add_task(self._label, total=None, amount="")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        with self._lock:
            self._closed = True
            for timer in self._timers.values():
                timer.cancel()
            self._timers.clear()
            if self._progress is not None:
                self._progress.stop()
                self._progress = None

    def advance(self, done: int, total: int) -> None:
        if self._task is not None and self._progress is not None:
            self._progress.update(self._task, completed=done, total=total, amount=f"{done}/{total}")

    def load(self, method: str, done: int, total: int) -> None:
        with self._lock:
            if self._closed:
                return
            self._latest[method] = (done, total)
            task = self._load.get(method)
            if done >= total:
                timer = self._timers.pop(method, None)
                if timer is not None:
                    timer.cancel()
                if task is not None and self._progress is not None:
                    self._progress.remove_task(task)
                    del self._load[method]
                    if self._task is None and not self._load:  # nothing left to show: lines printed next stay clean
                        self._progress.stop()
                        self._progress = None
                return
            self._started.setdefault(method, time.monotonic())
            if task is None and method not in self._timers:
                timer = threading.Timer(LOAD_BAR_AFTER_S, self._show_load, (method,))
                timer.daemon = True
                self._timers[method] = timer
                timer.start()
            elif task is not None and self._progress is not None:
                self._progress.update(task, completed=done, total=total, amount=_bytes_amount(done, total, self._started[method]))

    def _show_load(self, method: str) -> None:
        with self._lock:
            if self._timers.pop(method, None) is None or self._closed:
                return  # finished (or the display closed) meanwhile
            done, total = self._latest[method]
            amount = _bytes_amount(done, total, self._started[method])
            self._load[method] = self._display().add_task(f"loading {method}", total=total, completed=done, amount=amount)

    def _display(self) -> Any:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[amount]}"), TimeElapsedColumn())
            self._progress = Progress(*columns, console=Console(file=self._stream), transient=True)
            self._progress.start()
        return self._progress


def _bytes_amount(done: int, total: int, started: float) -> str:
    """'1.20/2.20 GB, 21.3 GB/s' of a load started at `started` (time.monotonic)."""
    elapsed = time.monotonic() - started
    rate = f", {done / elapsed / 1e9:.1f} GB/s" if elapsed > 0 and done else ""
    return f"{done / 1e9:.2f}/{total / 1e9:.2f} GB{rate}"

"""Threads that must not be lost to Ctrl-C: started with interrupts held back,
and waited for to their end through any interrupt.

A load starts helper threads that read the bundle mapping or the library
(matching constant names, letting registrations go). Once a load fails those
are let go, so every such thread must be seen to its end first, whatever
interrupt arrives meanwhile: Ctrl-C (KeyboardInterrupt) or the CLI's own
(errors.Interrupted, on SIGTERM and SIGHUP).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import Interrupted


@contextlib.contextmanager
def held_back() -> Iterator[None]:
    """Hold interrupt signals back while a thread starts: raised inside
    Thread.start(), one left the thread running where nothing waited for it.
    They arrive once this ends (the new thread inherits the mask, and Python
    handles signals on the main thread only)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def finish_through(step: Callable[[], Any]) -> None:
    """Run `step` (a wait of milliseconds) to its end through any interrupt: Ctrl-C
    (KeyboardInterrupt) or the CLI's own (errors.Interrupted); the first is raised after."""
    interrupted: BaseException | None = None
    while True:
        try:
            step()
            break
        except (KeyboardInterrupt, Interrupted) as error:
            interrupted = interrupted or error
    if interrupted is not None:
        raise interrupted

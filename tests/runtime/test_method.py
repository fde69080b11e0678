"""A failed load's digest checks (runtime/method.py): stopped, and waited for through interrupts."""

from __future__ import annotations

import threading
from concurrent import futures

from cuda_runner.errors import Interrupted
from cuda_runner.runtime import method


def test_a_running_check_is_waited_for_through_an_interrupt(monkeypatch):
    reading = threading.Event()
    release = threading.Event()

    def check():
        reading.set()
        assert release.wait(10)

    with futures.ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(check)
        queued = pool.submit(check)
        assert reading.wait(10)
        real_wait = futures.wait
        calls = []

        def interrupted_once(waited, *args, **kwargs):
            calls.append(len(waited))
            if len(calls) == 1:
                release.set()
                raise Interrupted(15)
            return real_wait(waited, *args, **kwargs)

        monkeypatch.setattr(method.futures, "wait", interrupted_once)
        method._stop_checks([running, queued])  # the interrupt is dropped: the load's own error is raised
        assert running.done() and queued.cancelled() and calls == [2, 2]


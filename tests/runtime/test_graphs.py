"""CUDA graph capture (runtime/graphs.py), what can be checked without a GPU:
the order of things before a capture. Captures themselves are tested on the GPU."""

from __future__ import annotations

import pytest

from cuda_runner.runtime import graphs


class Stream:
    ptr = 7

    def __init__(self, events: list[str]):
        self.events = events

    def synchronize(self) -> None:
        self.events.append("synchronize")


class Executor:
    device_index = 0

    def __init__(self, events: list[str]):
        self.events = events
        self.stream = Stream(events)
        self.shim = type("Shim", (), {"label": "cuda-runner shim"})()
        self.device_buffers = type("Buffers", (), {"get": lambda self, key, size: 0})()

    def use_device(self) -> None:
        self.events.append("use_device")


class Captured(Exception):
    pass


def test_a_capture_starts_once_the_loads_registrations_are_let_go(monkeypatch):
    """A load's registrations let go on another thread while a capture runs could end the capture."""
    events: list[str] = []

    class DriverGraph:
        def __init__(self, stream: int):
            pass

        def capture(self, run):
            events.append("capture")
            raise Captured

    monkeypatch.setattr(graphs, "_DriverGraph", DriverGraph)
    monkeypatch.setattr(graphs, "wait_for_releases", lambda: events.append("wait_for_releases"))
    executor = graphs.CudaGraphExecutor.__new__(graphs.CudaGraphExecutor)
    executor._executor, executor._dtypes, executor._graphs = Executor(events), [], {}
    with pytest.raises(Captured):
        executor._capture(())
    assert events == ["use_device", "synchronize", "wait_for_releases", "capture"]

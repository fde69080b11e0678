"""CUDA graph capture (runtime/graphs.py), what can be checked without a GPU:
the order of things before a capture, and how a replay stages its inputs.
Captures themselves are tested on the GPU."""

from __future__ import annotations

import numpy as np
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
        self.pinned = type("Pinned", (), {"get": lambda self, key, size: np.zeros(size, np.uint8)})()
        self.uploads: list[tuple[int, int]] = []

    def upload(self, index: int, array: np.ndarray, destination: int) -> int:
        self.uploads.append((index, destination))
        return destination

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


def _captured(staged: list[np.ndarray | None]) -> graphs._Captured:
    return graphs._Captured(graph=None, inputs=[100 + index for index in range(len(staged))], outputs=None,  # type: ignore[arg-type]
                            views=[], staged_inputs=staged, staged_outputs=[])


def test_a_replay_writes_the_native_row_major_bytes_of_each_small_input_where_the_graph_copies_them_from():
    executor = graphs.CudaGraphExecutor.__new__(graphs.CudaGraphExecutor)
    executor._executor = Executor([])
    values = np.arange(6, dtype=np.int32).reshape(2, 3)
    swapped = values.astype(">i4")  # big-endian, as a .npy file may hold it
    transposed = np.asfortranarray(values)
    staged = [np.zeros(24, np.uint8) for _ in range(3)]
    executor.stage_inputs(_captured(list(staged)), [swapped, transposed, values])
    for buffer in staged:
        np.testing.assert_array_equal(buffer.view(np.int32).reshape(2, 3), values)


def test_a_replay_uploads_the_inputs_the_graph_does_not_copy_into_their_static_buffers():
    executor = graphs.CudaGraphExecutor.__new__(graphs.CudaGraphExecutor)
    executor._executor = inner = Executor([])
    small = np.zeros(8, np.uint8)
    executor.stage_inputs(_captured([small, None]), [np.full(8, 3, np.uint8), np.zeros(4, np.uint8)])
    assert inner.uploads == [(1, 101)]
    assert small.tolist() == [3] * 8

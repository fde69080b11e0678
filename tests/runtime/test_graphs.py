"""CUDA graph capture (runtime/graphs.py), what can be checked without a GPU:
the order of things before a capture, and how a replay stages its inputs.
Captures themselves are tested on the GPU."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from cuda_runner.runtime import graphs


class Stream:
    ptr = 7

    def __init__(self, events: list[str]):
        self.events = events

    def synchronize(self) -> None:
        self.events.append("synchronize")


class Arena:
    def __init__(self, events: list[str]):
        self.events = events

    @contextlib.contextmanager
    def serving(self):
        self.events.append("serve arena")
        try:
            yield
        finally:
            self.events.append("stop arena")

    def release(self) -> None:
        self.events.append("release arena")


class Shim:
    label = "cuda-runner shim"
    device_cuda = 1

    def __init__(self, events: list[str]):
        self.events = events

    def open_arena(self, device_index: int) -> Arena:
        self.events.append(f"open arena on {device_index}")
        return Arena(self.events)


class Executor:
    device_index = 0

    def __init__(self, events: list[str]):
        self.events = events
        self.stream = Stream(events)
        self.shim = Shim(events)
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
    executor._executor, executor._dtypes, executor._graphs, executor._arena = Executor(events), [], {}, None
    with pytest.raises(Captured):
        executor._capture(())
    assert events == ["use_device", "synchronize", "wait_for_releases", "open arena on 0", "serve arena", "capture", "stop arena"]


def _captured(staged: list[np.ndarray | None], graph: object = None, views: list | None = None) -> graphs._Captured:
    return graphs._Captured(graph=graph, inputs=[100 + index for index in range(len(staged))], outputs=None,  # type: ignore[arg-type]
                            views=views or [], staged_inputs=staged, staged_outputs=[None] * len(views or []))


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


def test_a_replay_refuses_an_input_of_another_size_than_its_graph_was_captured_for():
    """np.copyto would broadcast one byte over an int64's eight."""
    from cuda_runner.errors import InputError

    executor = graphs.CudaGraphExecutor.__new__(graphs.CudaGraphExecutor)
    executor._executor = Executor([])
    with pytest.raises(InputError, match="holds 1 bytes; its graph was captured for 8"):
        executor.stage_inputs(_captured([np.zeros(8, np.uint8)]), [np.array(1, np.uint8)])


def test_a_replay_interrupted_before_its_wait_still_waits_for_the_launch():
    """The next call rewrites the pinned inputs this launch's copies may not have read yet."""
    events: list[str] = []

    class Graph:
        def replay(self) -> None:
            events.append("replay")

    inner = Executor(events)

    def interrupted(index: int, view: object) -> np.ndarray:
        raise KeyboardInterrupt

    inner.download = interrupted  # type: ignore[method-assign]
    executor = graphs.CudaGraphExecutor.__new__(graphs.CudaGraphExecutor)
    executor._executor = inner
    with pytest.raises(KeyboardInterrupt):
        executor._replay(_captured([], graph=Graph(), views=["an output downloaded after the launch"]), [])
    assert events == ["use_device", "replay", "synchronize"]


def _fake_run_capture(monkeypatch, events: list, capture) -> graphs.CudaGraphExecutor:
    """A CudaGraphExecutor whose container's Run returns handles 41 and 42, captured by `capture(run)`."""

    class Handles:
        def __init__(self, shim: object, handles: list[int]):
            self.handles = handles

        def release(self) -> None:
            events.append(("release outputs", self.handles))

    class DriverGraph:
        def __init__(self, stream: int):
            pass

        def capture(self, run):
            return capture(run)

    inner = Executor(events)
    inner.runtime = type("Runtime", (), {"memcpyAsync": lambda *args: None})()
    monkeypatch.setattr(graphs, "_DriverGraph", DriverGraph)
    monkeypatch.setattr(graphs, "OwnedHandles", Handles)
    monkeypatch.setattr(graphs, "wait_for_releases", lambda: None)
    monkeypatch.setattr(graphs, "wrap_memory", lambda *args: 0)
    executor = graphs.CudaGraphExecutor.__new__(graphs.CudaGraphExecutor)
    executor._executor, executor._dtypes, executor._graphs, executor._arena = inner, ["float32"], {}, None
    executor._container = type("Container", (), {"run": lambda self, handles, stream, single_threaded: [41, 42]})()
    executor._describe = lambda handle: graphs.TensorView.of(4096, "float32", (2,), (1,))
    return executor


def test_a_methods_captures_take_their_memory_from_one_arena_served_only_while_each_runs(monkeypatch):
    """Allocations outside a capture (ordinary calls) must not come from it; the
    graphs share it, and closing the executor frees it after their outputs."""
    events: list = []

    def capture(run):
        events.append("capture")
        return run()

    executor = _fake_run_capture(monkeypatch, events, capture)
    executor._graphs[((2,),)] = executor._capture(((2,),))
    executor._graphs[((3,),)] = executor._capture(((3,),))
    assert [event for event in events if "arena" in str(event) or event == "capture"] == [
        "open arena on 0", "serve arena", "capture", "stop arena", "serve arena", "capture", "stop arena"]
    events.clear()
    for captured in executor._graphs.values():
        captured.graph = type("Graph", (), {"reset": lambda self: events.append("reset graph")})()
    executor._executor.close = lambda: events.append("close executor")
    executor.close()
    assert events == ["synchronize", ("release outputs", [41, 42]), "reset graph", ("release outputs", [41, 42]), "reset graph",
                      "release arena", "close executor"]  # the memory goes after everything that held it


def test_with_the_arena_off_a_capture_opens_none(monkeypatch):
    events: list = []
    monkeypatch.setattr(graphs, "GRAPH_ARENA", False)
    executor = _fake_run_capture(monkeypatch, events, lambda run: run())
    executor._capture(((2,),))
    assert executor._arena is None and not [event for event in events if "arena" in str(event)]


def test_outputs_of_a_run_whose_capture_then_failed_are_released(monkeypatch):
    events: list = []

    def capture(run):
        run()
        raise graphs.ModelRuntimeError("CUDA graph: cuStreamEndCapture failed")

    executor = _fake_run_capture(monkeypatch, events, capture)
    with pytest.raises(graphs.ModelRuntimeError, match="EndCapture"):
        executor._capture(((2,),))
    # The arena stops serving before the outputs go back to it; it is kept for the next capture.
    assert [event for event in events if "arena" in str(event) or "outputs" in str(event)] == [
        "open arena on 0", "serve arena", "stop arena", ("release outputs", [41, 42])]

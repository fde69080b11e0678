"""CUDA graph capture (runtime/graphs.py), what can be checked without a GPU:
the order of things before a capture, and how a replay stages its inputs.
Captures themselves are tested on the GPU."""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

from cuda_runner.format.manifest import DeviceSpec, MethodSpec, TensorSpec
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
        executor._capture(False, ())
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
        """Captures through `capture`; replays from C through callbacks that record
        the launch and the wait, and "run" the model by writing 2.5 into every output."""

        def __init__(self, stream: int):
            self.outputs: list[np.ndarray] = []

            def launch(graph: int, stream: int) -> int:
                events.append("C launch")
                for buffer in self.outputs:
                    buffer.view(np.float32)[:] = 2.5
                return 0

            def current(context: ctypes.Array) -> int:
                context[0] = 1
                return 0

            self._callbacks = (ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(launch),
                               ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda stream: events.append("C synchronize") or 0),
                               ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))(current),
                               ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda context: 0))

        def capture(self, run):
            return capture(run)

        def native_parts(self) -> dict:
            launch, synchronize, current, make_current = (ctypes.cast(callback, ctypes.c_void_p).value for callback in self._callbacks)
            return {"launch": launch, "synchronize": synchronize, "current": current, "make_current": make_current, "graph": 3,
                    "stream": Stream.ptr, "context": 1, "fail": lambda function, status: None}

    inner = Executor(events)
    inner.runtime = type("Runtime", (), {"memcpyAsync": lambda self, *args: events.append(("copy", *args))})()
    monkeypatch.setattr(graphs, "_DriverGraph", DriverGraph)
    monkeypatch.setattr(graphs, "OwnedHandles", Handles)
    monkeypatch.setattr(graphs, "wait_for_releases", lambda: None)
    monkeypatch.setattr(graphs, "wrap_memory", lambda *args: 0)
    executor = graphs.CudaGraphExecutor.__new__(graphs.CudaGraphExecutor)
    executor._executor, executor._dtypes, executor._graphs, executor._arena = inner, ["float32"], {}, None
    executor._spec = MethodSpec("f", DeviceSpec("cuda"), "library", None, (TensorSpec("x", "float32", (2,)),),
                                (TensorSpec("y", "float32", (2,)), TensorSpec("z", "float32", (2,))), {}, "2.11")
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
    executor._graphs[(False, ((2,),))] = executor._capture(False, ((2,),))
    executor._graphs[(True, ((3,),))] = executor._capture(True, ((3,),))
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
    executor._capture(False, ((2,),))
    assert executor._arena is None and not [event for event in events if "arena" in str(event)]


def test_outputs_of_a_run_whose_capture_then_failed_are_released(monkeypatch):
    events: list = []

    def capture(run):
        run()
        raise graphs.ModelRuntimeError("CUDA graph: cuStreamEndCapture failed")

    executor = _fake_run_capture(monkeypatch, events, capture)
    with pytest.raises(graphs.ModelRuntimeError, match="EndCapture"):
        executor._capture(False, ((2,),))
    # The arena stops serving before the outputs go back to it; it is kept for the next capture.
    assert [event for event in events if "arena" in str(event) or "outputs" in str(event)] == [
        "open arena on 0", "serve arena", "stop arena", ("release outputs", [41, 42])]


def test_a_graph_for_device_arrays_copies_nothing_from_or_to_the_host(monkeypatch):
    """The host calls' graph copies its inputs from pinned buffers of its own, which
    would overwrite the device arrays copied in; a device call's graph holds no copy."""
    events: list = []
    executor = _fake_run_capture(monkeypatch, events, lambda run: run())
    pinned: list = []
    executor._executor.pinned = type("Pinned", (), {"get": lambda self, key, size: pinned.append(key) or np.zeros(size, np.uint8)})()
    device = executor._capture(True, ((2,),))
    assert device.staged_inputs == [None] and device.staged_outputs == [None, None]
    assert not pinned and not [event for event in events if event[0] == "copy"]
    host = executor._capture(False, ((2,),))
    assert all(staging is not None for staging in host.staged_inputs + host.staged_outputs)
    assert [event[4] for event in events if event[0] == "copy"] == [graphs.HOST_TO_DEVICE, graphs.DEVICE_TO_HOST, graphs.DEVICE_TO_HOST]


_ADDRESSES = {"x": 500, "x made row-major": 600}  # fixed: the test tells the arrays apart by them


class DeviceArray:
    def __init__(self, name: str, nbytes: int, contiguous: bool = True):
        self.name, self.nbytes, self.shape = name, nbytes, (nbytes // 4,)
        self.flags = type("Flags", (), {"c_contiguous": contiguous})()
        self.data = type("Pointer", (), {"ptr": _ADDRESSES[name]})()


def test_run_device_warms_up_then_queues_its_copies_and_the_replay_and_waits_for_nothing(monkeypatch):
    events: list = []

    class Graph:
        def replay(self) -> None:
            events.append("replay")

    executor = _fake_run_capture(monkeypatch, events, lambda run: run())
    executor._calls, executor._max_graphs, executor.capture_seconds = {}, 8, []
    inner = executor._executor
    inner.run_device = lambda arrays: events.append("ordinary call") or ["plain output"]
    inner.contiguous_device = lambda array: array if array.flags.c_contiguous else DeviceArray(array.name + " made row-major", array.nbytes)
    captured: list = []
    inner.copy_of_output = lambda view, owner: events.append(("copy out", view.address, owner is captured[0])) or f"copy of {view.address}"
    real_capture = executor._capture

    def capture_with_graph(device_arrays: bool, shapes):
        captured.append(real_capture(device_arrays, shapes))
        captured[0].graph = Graph()  # stands in for the driver's
        return captured[0]

    executor._capture = capture_with_graph  # type: ignore[method-assign]
    arrays = [DeviceArray("x", 8, contiguous=False)]
    for _ in range(graphs.WARMUP_CALLS):
        assert executor.run_device(arrays) == ["plain output"]
    assert executor.graphs == 0
    events.clear()
    outputs = executor.run_device(arrays)
    assert list(executor._graphs) == [(True, ((2,),))]
    copies_in = [event for event in events if event[0] == "copy"]
    assert copies_in == [("copy", captured[0].inputs[0], DeviceArray("x made row-major", 8).data.ptr, 8, graphs.DEVICE_TO_DEVICE, Stream.ptr)]
    assert events.index(copies_in[0]) < events.index("replay") < events.index(("copy out", 4096, True))
    assert outputs == ["copy of 4096", "copy of 4096"] and "ordinary call" not in events
    events.clear()  # the capture waited for the stream before it began; a replay waits for nothing
    executor.run_device(arrays)
    assert "replay" in events and "synchronize" not in events
    # A host call of the same shapes is not this graph's: it warms up on its own.
    inner.run = lambda arrays, phases=None: ["host output"]
    assert executor.run([np.zeros(2, np.float32)]) == ["host output"] and executor.graphs == 1


def _needs_graph_call() -> None:
    pytest.importorskip("cuda_runner._graph_call", reason="built by pip install (scripts/test.sh)")


def test_a_host_graph_makes_its_calls_in_c_from_its_own_pinned_buffers(monkeypatch):
    """The fast call writes the input where the captured copy reads it, launches, waits, and copies each output out."""
    _needs_graph_call()
    events: list = []
    executor = _fake_run_capture(monkeypatch, events, lambda run: run())
    captured = executor._capture(False, ((2,),))
    assert captured.fast_call is not None
    captured.graph.outputs = captured.staged_outputs
    events.clear()
    outputs = captured.fast_call.run({"x": np.array([1.0, 2.0], np.float32)})
    assert events == ["C launch", "C synchronize"]
    assert captured.staged_inputs[0].view(np.float32).tolist() == [1.0, 2.0]
    assert list(outputs) == ["y", "z"] and all(output.tolist() == [2.5, 2.5] and output.dtype == np.float32 for output in outputs.values())
    # Replaying through Python points the executor's fast call at the graph it replayed; closing drops it before the reset.
    executor._graphs[(False, ((2,),))] = captured
    captured.graph.replay = lambda: events.append("replay")
    executor.run([np.zeros(2, np.float32)])
    assert executor.fast_call is captured.fast_call
    fast_call = captured.fast_call
    captured.graph.reset = lambda: events.append(("reset", executor.fast_call, captured.fast_call))
    executor._executor.close = lambda: None
    executor.close()
    assert ("reset", None, None) in events
    with pytest.raises(RuntimeError, match="closed"):  # closed before the graph and its buffers went, wherever it is still held
        fast_call.run({"x": np.zeros(2, np.float32)})


def test_a_fast_call_that_cannot_be_made_leaves_the_captured_graph_to_python(monkeypatch):
    """The capture went through: its graph and outputs are kept and replayed, not lost with the call."""
    _needs_graph_call()
    events: list = []
    executor = _fake_run_capture(monkeypatch, events, lambda run: run())

    def no_parts() -> dict:
        raise graphs.ModelRuntimeError("CUDA graph: cuCtxGetCurrent failed")

    monkeypatch.setattr(graphs._DriverGraph, "native_parts", lambda self: no_parts())
    captured = executor._capture(False, ((2,),))
    assert captured.fast_call is None and captured.outputs is not None


def test_a_device_graph_or_one_with_copies_outside_it_makes_no_c_calls(monkeypatch):
    _needs_graph_call()
    events: list = []
    executor = _fake_run_capture(monkeypatch, events, lambda run: run())
    assert executor._capture(True, ((2,),)).fast_call is None  # run_device's: no host buffers
    executor._describe = lambda handle: graphs.TensorView.of(4096, "float32", (2, 2), (1, 2))  # a transposed output: gathered in Python
    assert executor._capture(False, ((2,),)).fast_call is None
    executor._describe = lambda handle: graphs.TensorView.of(4096, "float32", (2,), (1,))
    with monkeypatch.context() as patched:
        patched.setattr(graphs, "PIPELINE_MIN_BYTES", 8)  # the input is uploaded before each launch, not copied by the graph
        assert executor._capture(False, ((2,),)).fast_call is None
    assert executor._capture(False, ((2,),)).fast_call is not None
    monkeypatch.setattr(graphs, "GRAPH_C_CALLS", False)
    assert executor._capture(False, ((2,),)).fast_call is None


def test_a_graphed_lane_hands_out_its_cuda_lanes_pinned_inputs_and_keeps_them_through_reset_state():
    """Method.pinned_input on a graphed method was refused as if the method were on no GPU."""
    calls: list = []

    class Lane:
        def pinned_input(self, index, shape, dtype):
            calls.append(("pinned_input", index, shape, dtype))
            return np.zeros(shape, np.float32)

        def take_over(self, old):
            calls.append(("take_over", old))

    new, old = (graphs.CudaGraphExecutor.__new__(graphs.CudaGraphExecutor) for _ in range(2))
    new._executor, old._executor = Lane(), "the old CUDA lane"
    assert new.pinned_input(1, (2, 3), "float32").shape == (2, 3)
    new.take_over(old)
    assert calls == [("pinned_input", 1, (2, 3), "float32"), ("take_over", "the old CUDA lane")]

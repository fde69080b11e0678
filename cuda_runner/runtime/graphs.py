"""CUDA graphs (`--cuda-graph`): one captured Run per concrete input shape.

A call of a shape seen before replays its graph. The graph holds its own
copies in and out: the capture queues, around the Run, the copies from
pinned host buffers of the graph's own into its static input buffers and
from the outputs into more such buffers. A replay then only writes the
inputs' bytes into pinned memory, launches the graph, waits, and copies the
outputs into fresh arrays: no copy is queued call by call (on the H200 a
small decoder's graphed call took 51 us against 63-71 in two of three
rounds of scripts/bench_graph_copies.py, 61 against 58 in the first; on
the 1B decoder the call did not change within the spread of its runs).
Inputs of PIPELINE_MIN_BYTES or more are still uploaded before the launch,
through the chunked staging that overlaps the host's copy with the
transfer, and outputs of POOLED_MIN_BYTES or more are downloaded after the
launch into the executor's own buffer (a graph keeps its pinned buffers
for its life, one graph per shape). libtorch's graphs, captured through
torch, hold the inputs' copies only.

A graph captured through the driver makes those host calls in C where it
can (`fast_call`, cuda_runner/native/graph_call.c): Method.run hands it the
inputs by name, and it checks them against the graph's dtypes, shapes and
bounds, stages them, launches, waits and copies the outputs out in one
foreign call. Whatever it does not take (another shape, a strided or
big-endian array, a value out of bounds) it returns having queued nothing,
and the call is made here, in Python (scripts/bench_graph_host_call.py
times the two on the host; docs/benchmarks.md has the figures).

`run_device` (CuPy arrays) replays graphs of its own, one per shape, that
copy nothing from or to the host: each call queues the copies of its arrays
into the graph's input buffers, the launch, and a private copy of each
output (the next replay rewrites the graph's), and returns without waiting,
so a decode loop that picks its tokens on the GPU queues step after step
while the GPU runs the ones before.

The first calls of each shape run as ordinary calls (they load kernels and
set up what the library does lazily); the next one is captured, which
executes nothing, and its graph is then launched once for that call. Every
call therefore runs on the real inputs in order, so state a method keeps
(a KV cache in its buffers) carries from call to call, graphed or not, as
ExecuTorch's enable_cuda_graph_for_method does. A method with dynamic
dimensions gets one graph per shape seen, up to `MAX_GRAPHS`; further
shapes run as ordinary calls.

Who allocates the Run's tensors decides how to capture:
- libtorch: its caching allocator must switch to a private graph pool while
  capturing; that switch is reachable only through torch's Python module, so
  this path imports torch (about 3.6 s, once).
- cuda-runner's shim: the graph is captured and replayed through the CUDA
  driver API with no torch at all. The capture's allocations come from an
  arena the method's graphs share (GRAPH_ARENA). Without it the shim's
  stream-ordered allocations (cuMemAllocAsync on the capturing stream) and
  frees would each be a memory node of the graph, 81 of them beside a 1B
  decoder step's 98 kernels, each a
  step of the replay and a break between two kernels that could otherwise
  overlap as programmatic dependents. CUDA_RUNNER_GRAPH_ARENA=0 captures
  them as memory nodes, instantiated with auto-free-on-launch so that each
  replay frees the last replay's outputs and allocates them again at the
  same addresses.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arrays import numpy_dtype
from ..errors import InputError, ModelRuntimeError
from ..format.manifest import MethodSpec
from .cuda import DEVICE_TO_DEVICE, DEVICE_TO_HOST, HOST_TO_DEVICE, CudaExecutor
from .executor import Executor
from .pinned import PIPELINE_MIN_BYTES, POOLED_MIN_BYTES
from .shim import GraphArena
from .tensors import Describer, OwnedHandles, TensorView, contiguous_strides, gather, span_nbytes, wrap_memory
from .upload import wait_for_releases

#: Ordinary calls of a shape before it is captured (ExecuTorch's CUDA backend also runs three).
WARMUP_CALLS = 3
#: Graphs kept per method: one per input shape; calls of further shapes are not graphed.
MAX_GRAPHS = 8
#: Whether graphs captured from now on hold their copies (False: each replay queues them, the earlier way;
#: scripts/bench_graph_copies.py times both).
COPIES_IN_GRAPH = True
#: Whether captures through the driver take their device memory from an arena the method's graphs share (see the
#: module docstring); CUDA_RUNNER_GRAPH_ARENA=0 turns it off.
GRAPH_ARENA = os.environ.get("CUDA_RUNNER_GRAPH_ARENA", "1") != "0"
#: Whether a graph captured through the driver for host arrays makes its calls in C where it can (see `fast_call`);
#: CUDA_RUNNER_GRAPH_C_CALLS=0 leaves every call to Python, for an A/B.
GRAPH_C_CALLS = os.environ.get("CUDA_RUNNER_GRAPH_C_CALLS", "1") != "0"

Shapes = tuple[tuple[int, ...], ...]
# What a graph is captured for: run (host arrays, the graph holding their copies) or run_device (device
# arrays, copied into the graph's inputs before each launch), and the input shapes.
GraphKey = tuple[bool, Shapes]


def _shapes(arrays: list[Any]) -> Shapes:
    """The arrays' shapes, as plain integers: the key of a graph."""
    return tuple(tuple(int(size) for size in array.shape) for array in arrays)


@dataclass
class _Captured:
    graph: _TorchGraph | _DriverGraph
    inputs: list[int]  # static input buffers: the captured kernels read these addresses on every replay
    outputs: OwnedHandles
    views: list[TensorView]
    # Pinned bytes the graph copies each input from (None: uploaded before the launch), and each output's span
    # into (None: downloaded after the launch, as libtorch's graphs and large outputs are).
    staged_inputs: list[np.ndarray | None]
    staged_outputs: list[np.ndarray | None]
    # The whole host call in C (cuda_runner/native/graph_call.c), where this graph and the module allow it.
    fast_call: Any = None


class CudaGraphExecutor(Executor):
    """Runs a CudaExecutor's container through CUDA graphs, one per input shape (see the module docstring)."""

    offers_fast_calls = True

    def __init__(self, executor: CudaExecutor, spec: MethodSpec, max_graphs: int = MAX_GRAPHS):
        self._executor = executor
        self._container = executor.container
        self._spec = spec
        self._dtypes = [tensor.dtype for tensor in spec.inputs]
        self._max_graphs = max_graphs
        self._graphs: dict[GraphKey, _Captured] = {}
        self._calls: dict[GraphKey, int] = {}  # ordinary calls made so far, per shape not yet captured
        self._describe = Describer(executor.shim)
        self._arena: GraphArena | None = None  # the graphs' memory, shared: they replay one at a time on one stream
        #: Seconds each capture took (the first call of each graphed shape pays it).
        self.capture_seconds: list[float] = []

    @property
    def graphs(self) -> int:
        """How many shapes have a graph."""
        return len(self._graphs)

    @property
    def arena_bytes(self) -> int:
        """Device memory the graphs' arena holds (0 where captures allocate through the stream-ordered allocator)."""
        return self._arena.nbytes if self._arena is not None else 0

    def run(self, arrays: list[np.ndarray], phases: dict[str, float] | None = None) -> list[np.ndarray]:
        captured = self._graph_for((False, _shapes(arrays)))
        if captured is None:
            return self._executor.run(arrays, phases)
        self.fast_call = captured.fast_call  # the shape called last is the one the next call most likely has
        return self._replay(captured, arrays)

    def device_inputs(self, arrays: Any, names: Any) -> list[Any]:
        return self._executor.device_inputs(arrays, names)

    def copy_device(self, array: Any) -> Any:
        return self._executor.copy_device(array)

    def pinned_input(self, index: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        # The lane's own pinned slot: a replay copies the array's bytes from it into the graph's staging.
        return self._executor.pinned_input(index, shape, dtype)

    def take_over(self, old: Executor) -> None:
        """reset_state's new lane keeps what the old one handed out through pinned_input."""
        self._executor.take_over(old._executor if isinstance(old, CudaGraphExecutor) else old)

    def run_device(self, arrays: list[Any]) -> list[Any]:
        """CuPy in, CuPy out, as CudaExecutor.run_device, through a graph of its
        own per shape: the inputs are copied into the graph's before the launch,
        and each output is a private copy of the graph's, all queued on the
        lane's stream; nothing waits for the GPU."""
        captured = self._graph_for((True, _shapes(arrays)))
        if captured is None:
            return self._executor.run_device(arrays)
        executor = self._executor
        executor.use_device()
        runtime, stream = executor.runtime, executor.stream.ptr
        # Read before anything is queued: an array CuPy must first make row-major is copied on this stream too.
        sources = [executor.contiguous_device(array) for array in arrays]
        for address, source in zip(captured.inputs, sources):
            if source.nbytes:
                runtime.memcpyAsync(address, source.data.ptr, source.nbytes, DEVICE_TO_DEVICE, stream)
        captured.graph.replay()
        # The next replay rewrites the graph's outputs: each caller gets its own copy, queued before that replay.
        return [executor.copy_of_output(view, captured) for view in captured.views]

    def _graph_for(self, key: GraphKey) -> _Captured | None:
        """The graph of `key`, captured now if its warm-up calls are done and
        the bound allows; None: this call runs as an ordinary one."""
        captured = self._graphs.get(key)
        if captured is None:
            seen = self._calls.get(key, 0)
            if seen < WARMUP_CALLS or len(self._graphs) >= self._max_graphs:
                if len(self._calls) < 4 * self._max_graphs:  # bounded: a method fed ever new shapes keeps no unbounded map
                    self._calls[key] = seen + 1
                return None
            started = time.perf_counter()
            captured = self._graphs[key] = self._capture(*key)
            self._calls.pop(key, None)
            self.capture_seconds.append(time.perf_counter() - started)
        return captured

    def _capture(self, device_arrays: bool, shapes: Shapes) -> _Captured:
        executor = self._executor
        executor.use_device()
        key = len(self._graphs)
        nbytes = [int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize for dtype, shape in zip(self._dtypes, shapes)]
        inputs = [executor.device_buffers.get(("graph", key, index), size) for index, size in enumerate(nbytes)]
        # Slots of this graph's own: a buffer the capture named must never be regrown for another call.
        # A graph for device arrays copies nothing from or to the host.
        in_graph = COPIES_IN_GRAPH and not device_arrays
        staged_inputs = [executor.pinned.get(("graph in", key, index), size) if size < PIPELINE_MIN_BYTES and in_graph else None
                         for index, size in enumerate(nbytes)]
        graph: _TorchGraph | _DriverGraph = (
            _TorchGraph(executor.stream.ptr, executor.device_index) if executor.shim.label == "libtorch" else _DriverGraph(executor.stream.ptr))
        shim, stream = executor.shim, executor.stream
        stream.synchronize()
        wait_for_releases()  # a load's registrations let go during a capture could end it (libtorch's captures refuse other threads' calls)
        views: list[TensorView] = []
        staged_outputs: list[np.ndarray | None] = []
        # Only a driver capture (relaxed mode) may allocate the outputs' pinned buffers while it runs:
        # libtorch's captures refuse such calls, and its outputs are downloaded after each launch instead.
        outputs_in_graph = isinstance(graph, _DriverGraph) and in_graph
        produced: list[int] = []

        def run() -> list[int]:
            for address, staging in zip(inputs, staged_inputs):
                if staging is not None and staging.nbytes:
                    executor.runtime.memcpyAsync(address, staging.ctypes.data, staging.nbytes, HOST_TO_DEVICE, stream.ptr)
            handles = [wrap_memory(shim, address, dtype, shape, contiguous_strides(shape), shim.device_cuda, executor.device_index)
                       for address, dtype, shape in zip(inputs, self._dtypes, shapes)]
            outputs = self._container.run(handles, stream.ptr, single_threaded=True)
            try:
                for index, handle in enumerate(outputs):
                    view = self._describe(handle)
                    views.append(view)
                    size = span_nbytes(view)
                    staging = None
                    # A large output shares the executor's download slot: pinned memory a graph keeps for
                    # itself would grow with every graph (one per shape) by the output's whole span.
                    if outputs_in_graph and size < POOLED_MIN_BYTES:
                        staging = executor.pinned.get(("graph out", key, index), size)
                        if size:
                            executor.runtime.memcpyAsync(staging.ctypes.data, view.address, size, DEVICE_TO_HOST, stream.ptr)
                    staged_outputs.append(staging)
            except BaseException:
                OwnedHandles(shim, list(outputs)).release()
                raise
            produced[:] = outputs
            return list(outputs)

        use_arena = isinstance(graph, _DriverGraph) and GRAPH_ARENA
        if use_arena and self._arena is None:
            self._arena = shim.open_arena(executor.device_index)
        serving = self._arena.serving() if use_arena and self._arena is not None else contextlib.nullcontext()
        try:
            with serving:
                outputs = OwnedHandles(shim, graph.capture(run))
        except BaseException:
            if produced:  # the Run went through and the capture failed after it: its outputs are still ours to free
                OwnedHandles(shim, produced).release()
            raise
        captured = _Captured(graph, inputs, outputs, views, staged_inputs, staged_outputs)
        if isinstance(graph, _DriverGraph) and not device_arrays:
            try:
                captured.fast_call = self._fast_call(captured, shapes, graph.native_parts)
            except Exception:  # the graph is captured and its outputs ours: Python makes its calls (the GPU suite checks C does)
                captured.fast_call = None
        return captured

    def _fast_call(self, captured: _Captured, shapes: Shapes, native_parts: Callable[[], dict[str, Any]]) -> Any:
        """The graph's host calls in C (see `fast_call`), or None: the module is
        not built, or an input or output is not copied by the graph itself.
        `native_parts`: what the C call launches and waits with (_DriverGraph.native_parts)."""
        staged = captured.staged_inputs + captured.staged_outputs
        if not GRAPH_C_CALLS or any(buffer is None for buffer in staged) or not all(view.contiguous for view in captured.views):
            return None
        try:
            from .. import _graph_call
        except ImportError:
            return None
        inputs = []
        for spec, shape, buffer in zip(self._spec.inputs, shapes, captured.staged_inputs):
            assert buffer is not None
            dtype = numpy_dtype(spec.dtype)
            bounds, span = ((*given, dtype.itemsize) if given is not None else None for given in (spec.bounds, spec.span_bounds))
            inputs.append((spec.name, dtype, shape, buffer.ctypes.data, buffer.nbytes, bounds, span))
        outputs = []
        for spec, view, buffer in zip(self._spec.outputs, captured.views, captured.staged_outputs):
            assert buffer is not None
            dtype = numpy_dtype(view.dtype)
            nbytes = view.numel * dtype.itemsize
            if buffer.nbytes < nbytes:
                return None
            outputs.append((spec.name, dtype, view.shape, buffer.ctypes.data, nbytes))
        return _graph_call.GraphCall(**native_parts(), inputs=inputs, outputs=outputs, array_type=np.ndarray, empty=np.empty,
                                     keep=(captured.staged_inputs, captured.staged_outputs))

    def _replay(self, captured: _Captured, arrays: list[np.ndarray]) -> list[np.ndarray]:
        executor = self._executor
        executor.use_device()
        self.stage_inputs(captured, arrays)
        captured.graph.replay()
        try:
            staged = self.queue_downloads(captured)
            executor.stream.synchronize()
        except BaseException:
            with contextlib.suppress(Exception):
                executor.stream.synchronize()  # the next call must not rewrite inputs this launch may still copy
            raise
        return [gather(buffer, view) for buffer, view in zip(staged, captured.views)]

    def queue_downloads(self, captured: _Captured) -> list[np.ndarray]:
        """After a launch: the pinned buffer each output lands in, queuing the
        downloads of those the graph does not copy out itself."""
        return [self._executor.download(index, view) if buffer is None else buffer
                for index, (buffer, view) in enumerate(zip(captured.staged_outputs, captured.views))]

    def stage_inputs(self, captured: _Captured, arrays: list[np.ndarray]) -> None:
        """Put the inputs where the graph copies them from: the bytes of small
        ones into its pinned buffers, large ones uploaded (queued) now."""
        for index, (array, staging) in enumerate(zip(arrays, captured.staged_inputs)):
            if staging is None:
                self._executor.upload(index, array, destination=captured.inputs[index])
            elif array.nbytes != staging.nbytes:
                raise InputError(f"input {index} holds {array.nbytes} bytes; its graph was captured for {staging.nbytes}")
            elif staging.nbytes:
                if not (array.dtype.isnative and array.flags.c_contiguous):  # the device reads native, row-major bytes
                    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
                np.copyto(staging, array.reshape(-1).view(np.uint8))

    @property
    def stream(self) -> Any:
        return self._executor.stream

    def close(self) -> None:
        self._executor.stream.synchronize()
        self.fast_call = None
        for captured in self._graphs.values():
            if captured.fast_call is not None:  # it would launch the graph reset below, into pinned memory freed after
                captured.fast_call.close()
                captured.fast_call = None
            captured.outputs.release()
            captured.graph.reset()
        self._graphs.clear()
        if self._arena is not None:  # last: the outputs just released held blocks of it
            self._arena.release()
            self._arena = None
        self._executor.close()


class _TorchGraph:
    """Capture through torch, for libraries bound to libtorch (its allocator's graph pool)."""

    def __init__(self, stream: int, device_index: int):
        import torch

        self._torch = torch
        self._device_index = device_index
        self._stream = torch.cuda.ExternalStream(stream, device=torch.device("cuda", device_index))
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, run: Any) -> list[int]:
        torch = self._torch
        with torch.cuda.device(self._device_index), torch.cuda.stream(self._stream):
            try:
                with torch.cuda.graph(self._graph, stream=self._stream):
                    return list(run())
            except RuntimeError as error:
                raise ModelRuntimeError(f"CUDA graph capture failed: {str(error).splitlines()[0]}") from error

    def replay(self) -> None:
        with self._torch.cuda.stream(self._stream):
            self._graph.replay()

    def reset(self) -> None:
        self._graph.reset()


# CUgraphNodeType's values, as cuda.h numbers them.
_NODE_KINDS = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph", 5: "empty", 6: "event wait", 7: "event record",
               8: "semaphore signal", 9: "semaphore wait", 10: "memory allocation", 11: "memory free", 12: "memory operations",
               13: "conditional"}
_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED: other threads may go on using CUDA
_AUTO_FREE_ON_LAUNCH = 1  # CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH


class _DriverGraph:
    """Capture and replay through the CUDA driver API, for libraries on cuda-runner's shim."""

    def __init__(self, stream: int):
        self._driver = ctypes.CDLL("libcuda.so.1")
        self._stream = ctypes.c_void_p(stream)
        self._graph = ctypes.c_void_p()
        self._exec = ctypes.c_void_p()
        self._launch = self._driver.cuGraphLaunch  # looked up once: it is called every replay

    def _call(self, name: str, *arguments: Any) -> None:
        self._check(name, getattr(self._driver, name)(*arguments))

    def _check(self, name: str, status: int) -> None:
        if status != 0:
            message = ctypes.c_char_p()
            self._driver.cuGetErrorString(status, ctypes.byref(message))
            raise ModelRuntimeError(f"CUDA graph: {name} failed: CUDA error {status} ({(message.value or b'unknown').decode()})")

    def capture(self, run: Any) -> list[int]:
        self._call("cuStreamBeginCapture_v2", self._stream, ctypes.c_int(_CAPTURE_MODE_RELAXED))
        try:
            handles = list(run())
        except BaseException:
            graph = ctypes.c_void_p()
            self._driver.cuStreamEndCapture(self._stream, ctypes.byref(graph))  # leave the stream usable
            if graph.value:
                self._driver.cuGraphDestroy(graph)
            raise
        self._call("cuStreamEndCapture", self._stream, ctypes.byref(self._graph))
        self._call("cuGraphInstantiateWithFlags", ctypes.byref(self._exec), self._graph, ctypes.c_ulonglong(_AUTO_FREE_ON_LAUNCH))
        return handles

    def replay(self) -> None:
        self._check("cuGraphLaunch", self._launch(self._exec, self._stream))

    def native_parts(self) -> dict[str, Any]:
        """What a GraphCall needs to replay this graph from C: the driver's
        functions, the graph, its stream, and the context current now (the
        executor's device), which a call in C makes current where another is."""
        context = ctypes.c_void_p()
        self._call("cuCtxGetCurrent", ctypes.byref(context))

        def address(function: Any) -> int:
            return ctypes.cast(function, ctypes.c_void_p).value or 0

        driver = self._driver
        return {"launch": address(self._launch), "synchronize": address(driver.cuStreamSynchronize), "current": address(driver.cuCtxGetCurrent),
                "make_current": address(driver.cuCtxSetCurrent), "graph": self._exec.value, "stream": self._stream.value,
                "context": context.value, "fail": self._check}

    def node_kinds(self) -> dict[str, int]:
        """How many nodes of each kind the captured graph holds (kernels, copies,
        memory allocations and frees, ...): what a launch of it walks."""
        count = ctypes.c_size_t()
        self._call("cuGraphGetNodes", self._graph, None, ctypes.byref(count))
        nodes = (ctypes.c_void_p * count.value)()
        self._call("cuGraphGetNodes", self._graph, nodes, ctypes.byref(count))
        kinds: dict[str, int] = {}
        for node in nodes[:count.value]:
            kind = ctypes.c_int()
            self._call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
            name = _NODE_KINDS.get(kind.value, f"kind {kind.value}")
            kinds[name] = kinds.get(name, 0) + 1
        return kinds

    def reset(self) -> None:
        if self._exec.value:
            self._driver.cuGraphExecDestroy(self._exec)
            self._exec = ctypes.c_void_p()
        if self._graph.value:
            self._driver.cuGraphDestroy(self._graph)
            self._graph = ctypes.c_void_p()

"""CUDA graphs for static-shape methods (`--cuda-graph`).

One Run is captured into a CUDA graph with static input buffers; each call then
copies the inputs into those buffers, replays the graph and copies the outputs
out of the addresses the capture left them at.

Who allocates the Run's tensors decides how to capture:
- libtorch: its caching allocator must switch to a private graph pool while
  capturing; that switch is reachable only through torch's Python module, so
  this path imports torch (about 3.6 s, once).
- cuda-runner's shim: it allocates stream-ordered (cuMemAllocAsync) on the
  capturing stream, so allocations become the graph's own memory nodes, and
  the graph is captured and replayed through the CUDA driver API with no
  torch at all. Instantiated with auto-free-on-launch, each replay frees the
  last replay's outputs and allocates them again at the same addresses.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..arrays import numpy_dtype
from ..errors import InputError, ModelRuntimeError
from ..format.manifest import MethodSpec
from .cuda import CudaExecutor
from .executor import Executor
from .tensors import Describer, OwnedHandles, contiguous_strides, gather, wrap_memory

_WARMUP_RUNS = 3


class CudaGraphExecutor(Executor):
    """Replays one captured Run. Owns the static inputs and the captured outputs."""

    def __init__(self, executor: CudaExecutor, spec: MethodSpec):
        if spec.dims or any(not isinstance(entry, int) for tensor in (*spec.inputs, *spec.outputs) for entry in tensor.shape):
            raise InputError(f"a CUDA graph needs static shapes; method {spec.name!r} has dynamic dimensions", subject="cuda_graph")
        self._executor = executor
        self._container = executor.container
        self._dtypes = [tensor.dtype for tensor in spec.inputs]
        self._shapes = [tuple(int(size) for size in tensor.shape) for tensor in spec.inputs]  # static: checked above
        self._nbytes = [int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize for dtype, shape in zip(self._dtypes, self._shapes)]
        # Static input buffers: the captured kernels read these addresses on every replay.
        self._inputs = [executor.device_buffers.get(("graph", index), nbytes) for index, nbytes in enumerate(self._nbytes)]
        self._graph: _TorchGraph | _DriverGraph = (
            _TorchGraph(executor.stream.ptr, executor.device_index) if executor.shim.label == "libtorch" else _DriverGraph(executor.stream.ptr))
        self._outputs = self._capture()
        describe = Describer(executor.shim)
        self._views = [describe(handle) for handle in self._outputs.handles]

    def _handles(self) -> list[int]:
        shim, executor = self._executor.shim, self._executor
        return [
            wrap_memory(shim, address, dtype, shape, contiguous_strides(shape), shim.device_cuda, executor.device_index)
            for address, dtype, shape in zip(self._inputs, self._dtypes, self._shapes)
        ]

    def _capture(self) -> OwnedHandles:
        shim, stream = self._executor.shim, self._executor.stream
        for _ in range(_WARMUP_RUNS):  # kernels are loaded by the first runs, outside the capture
            OwnedHandles(shim, self._container.run(self._handles(), stream.ptr, single_threaded=True)).release()
        stream.synchronize()
        handles = self._graph.capture(lambda: self._container.run(self._handles(), stream.ptr, single_threaded=True))
        return OwnedHandles(shim, handles)

    def run(self, arrays: list[np.ndarray], phases: dict[str, float] | None = None) -> list[np.ndarray]:
        executor = self._executor
        executor.use_device()
        for index, (address, array) in enumerate(zip(self._inputs, arrays)):
            executor.upload(index, array, destination=address)
        self._graph.replay()
        staged = [executor.download(index, view) for index, view in enumerate(self._views)]
        executor.stream.synchronize()
        return [gather(buffer, view) for buffer, view in zip(staged, self._views)]

    @property
    def stream(self) -> Any:
        return self._executor.stream

    def close(self) -> None:
        self._executor.stream.synchronize()
        self._outputs.release()
        self._graph.reset()
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


_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED: other threads may go on using CUDA
_AUTO_FREE_ON_LAUNCH = 1  # CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH


class _DriverGraph:
    """Capture and replay through the CUDA driver API, for libraries on cuda-runner's shim."""

    def __init__(self, stream: int):
        self._driver = ctypes.CDLL("libcuda.so.1")
        self._stream = ctypes.c_void_p(stream)
        self._graph = ctypes.c_void_p()
        self._exec = ctypes.c_void_p()

    def _call(self, name: str, *arguments: Any) -> None:
        status = getattr(self._driver, name)(*arguments)
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
        self._call("cuGraphLaunch", self._exec, self._stream)

    def reset(self) -> None:
        if self._exec.value:
            self._driver.cuGraphExecDestroy(self._exec)
            self._exec = ctypes.c_void_p()
        if self._graph.value:
            self._driver.cuGraphDestroy(self._graph)
            self._graph = ctypes.c_void_p()

"""CUDA graphs for static-shape methods (`--cuda-graph`).

One Run is captured into a CUDA graph with static input buffers; each call then
copies the inputs into those buffers, replays the graph and copies the outputs
out of the addresses the capture left them at. The outputs are allocated by
libtorch's caching allocator, which must switch to a private graph pool while
capturing; that switch is reachable only through torch's Python module, so this
path imports torch (about 3.6 s, once) where the plain path does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import numpy_dtype
from ..errors import InputError, ModelRuntimeError
from ..format.manifest import MethodSpec
from .container import Container
from .cuda import CudaExecutor
from .executor import Executor
from .tensors import Describer, OwnedHandles, contiguous_strides, gather, wrap_memory

_WARMUP_RUNS = 3


class CudaGraphExecutor(Executor):
    """Replays one captured Run. Owns the static inputs and the captured outputs."""

    def __init__(self, executor: CudaExecutor, container: Container, spec: MethodSpec):
        if spec.dims or any(not isinstance(entry, int) for tensor in (*spec.inputs, *spec.outputs) for entry in tensor.shape):
            raise InputError(f"a CUDA graph needs static shapes; method {spec.name!r} has dynamic dimensions", subject="cuda_graph")
        import torch

        self._torch = torch
        self._executor = executor
        self._container = container
        self._dtypes = [tensor.dtype for tensor in spec.inputs]
        self._shapes = [tuple(int(size) for size in tensor.shape) for tensor in spec.inputs]  # static: checked above
        self._nbytes = [int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize for dtype, shape in zip(self._dtypes, self._shapes)]
        # Static input buffers: the captured kernels read these addresses on every replay.
        self._inputs = [executor.device_buffers.get(("graph", index), nbytes) for index, nbytes in enumerate(self._nbytes)]
        self._stream = torch.cuda.ExternalStream(executor.stream.ptr, device=torch.device("cuda", executor.device_index))
        self._graph = torch.cuda.CUDAGraph()
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
        torch, stream = self._torch, self._stream
        shim = self._executor.shim
        with torch.cuda.device(self._executor.device_index), torch.cuda.stream(stream):
            for _ in range(_WARMUP_RUNS):  # kernels are loaded by the first runs, outside the capture
                OwnedHandles(shim, self._container.run(self._handles(), stream.cuda_stream, single_threaded=True)).release()
            stream.synchronize()
            try:
                with torch.cuda.graph(self._graph, stream=stream):
                    handles = self._container.run(self._handles(), stream.cuda_stream, single_threaded=True)
            except RuntimeError as error:
                raise ModelRuntimeError(f"CUDA graph capture failed: {str(error).splitlines()[0]}") from error
        return OwnedHandles(shim, handles)

    def run(self, container: Container, dtypes: list[str], arrays: list[np.ndarray], phases: dict[str, float] | None = None) -> list[np.ndarray]:
        executor = self._executor
        executor.use_device()
        for index, (address, array) in enumerate(zip(self._inputs, arrays)):
            executor.upload(index, array, destination=address)
        with self._torch.cuda.stream(self._stream):
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

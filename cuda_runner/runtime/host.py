"""Host memory helpers and the CPU executor."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import numpy as np

from .container import Container
from .executor import Executor
from .invoke import CallHelper, Invoker, make_invoker
from .shim import Shim
from .tensors import TensorView, contiguous_strides, gather, span_nbytes

# The generated code clones (with a warning) inputs that are not 16-byte
# aligned; NumPy's allocations already are, so only odd views get copied.
INPUT_ALIGNMENT = 16


def buffer_address(buffer: memoryview | np.ndarray) -> int:
    """Address of a (possibly read-only) buffer, such as a view of the bundle mapping."""
    array = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, dtype=np.uint8)
    return int(array.ctypes.data) if array.size else 0


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + INPUT_ALIGNMENT, dtype=np.uint8)
    offset = (-raw.ctypes.data) % INPUT_ALIGNMENT
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def runnable_copy(array: np.ndarray) -> np.ndarray:
    """`array` itself if C-contiguous and aligned, else an aligned C-contiguous copy."""
    if array.flags.c_contiguous and array.ctypes.data % INPUT_ALIGNMENT == 0 and array.dtype.isnative:
        return array
    out = aligned_empty(array.shape, array.dtype.newbyteorder("="))
    out[...] = array
    return out


def copy_from_address(view: TensorView) -> np.ndarray:
    """A fresh C-contiguous NumPy copy of host memory described by `view`."""
    nbytes = span_nbytes(view)
    span = np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(view.address)).cast("B"), np.uint8) if nbytes else np.empty(0, np.uint8)
    return gather(span, view)


def load_weights_on_host(container: Container, weights: memoryview) -> None:
    container.load_weights(buffer_address(weights), weights.nbytes)


class CpuExecutor(Executor):
    """Runs a container on NumPy memory; outputs are copied out and their handles freed."""

    def __init__(self, shim: Shim, container: Container, dtypes: Sequence[str], helper: CallHelper | None = None):
        self.shim = shim
        self._invoker: Invoker = make_invoker(helper, shim, container, dtypes, shim.device_cpu, 0, None)

    def run(self, arrays: list[np.ndarray], phases: dict[str, float] | None = None) -> list[np.ndarray]:
        """With `phases`, host timers split the run into input preparation, the model and output copies."""
        clock = time.perf_counter
        started = clock()
        arrays = [runnable_copy(array) for array in arrays]
        # Every array is C-contiguous now; its size-1 dims may still carry any
        # stride (x[None], broadcast_to), which the library's own checks refuse.
        layouts = [(array.ctypes.data, array.shape, contiguous_strides(array.shape)) for array in arrays]
        prepared = clock()
        owned, views = self._invoker(layouts)
        try:  # first thing after the call: an interrupt at the clock left the handles to the next call
            computed = clock()
            # An output may view an input, so copy before `arrays` can go away.
            outputs = [copy_from_address(view) for view in views]
        finally:
            owned.release()
        if phases is not None:
            phases.update(copy_in=prepared - started, compute=computed - prepared, copy_out=clock() - computed)
        return outputs

    def close(self) -> None:
        pass  # nothing of its own: the container and the arrays belong to others

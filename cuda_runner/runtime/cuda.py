"""The CUDA executor: one stream per lane, pinned staging, CuPy arrays on request.

Pageable host<->device copies run at 6-9 GB/s on the H200 machine against
54 GB/s pinned (docs/aoti-abi.md, "Figures"), so every host copy goes through pinned
staging buffers that belong to the lane and grow as needed, and every copy
and the Run itself are ordered on the lane's own stream.

The host path drives the CUDA runtime through `cupy_backends` (CuPy's thin
runtime bindings, 3 ms to import) rather than `import cupy` (0.5 s), which
only `run_device` needs, for its CuPy arrays.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..arrays import numpy_dtype
from ..errors import DeviceError, InputError, ModelRuntimeError
from . import pinned
from .container import Container
from .executor import Executor
from .host import buffer_address
from .invoke import CallHelper, Invoker, make_invoker
from .shim import Shim
from .tensors import OwnedHandles, TensorView, contiguous_strides, gather, span_nbytes

# cudaMemcpyKind, cudaHostRegister and cudaStreamCreateWithFlags flag values.
HOST_TO_DEVICE = 1
DEVICE_TO_HOST = 2
DEVICE_TO_DEVICE = 3
HOST_REGISTER_READ_ONLY = 8
_STREAM_NON_BLOCKING = 1
_CUPY_MISSING = "running on CUDA needs CuPy; install it with: pip install 'cuda-runner[cuda12]' (or [cuda13])"


def cuda_runtime() -> Any:
    try:
        from cupy_backends.cuda.api import runtime
    except ImportError:
        raise DeviceError(_CUPY_MISSING) from None
    return runtime


def use_device(device_index: int) -> None:
    """Make `device_index` this thread's current device (CUDA calls that name no device use it)."""
    runtime = cuda_runtime()
    if runtime.getDevice() != device_index:
        runtime.setDevice(device_index)


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise DeviceError(_CUPY_MISSING) from None
    return cupy


class Stream:
    """A non-blocking CUDA stream owned by one lane (executor) of a method.

    Outputs handed out as CuPy arrays may outlive the method, and cuda-runner's
    shim frees an output on the stream that allocated it: so the stream is
    destroyed only once no such output is left (`hold`/`let_go`)."""

    def __init__(self, runtime: Any, device_index: int):
        self._runtime = runtime
        self.device_index = device_index
        self.ptr = runtime.streamCreateWithFlags(_STREAM_NON_BLOCKING)
        self._holders = 0
        self._closed = False
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._holders += 1

    def let_go(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._closed and self._holders == 0
        if last:
            self._destroy_now()

    def synchronize(self) -> None:
        self._runtime.streamSynchronize(self.ptr)

    def as_cupy(self) -> Any:
        """The same stream as a CuPy stream object, for `with stream:` blocks."""
        return _cupy().cuda.ExternalStream(self.ptr, self.device_index)

    def destroy(self) -> None:
        with self._lock:
            self._closed = True
            if self._holders:
                return  # the last output freed destroys it
        self._destroy_now()

    def _destroy_now(self) -> None:
        if self.ptr:
            self._runtime.streamDestroy(self.ptr)
            self.ptr = 0


class PinnedBuffers:
    """Reusable page-locked host buffers, one per slot, grown to powers of two."""

    def __init__(self, runtime: Any):
        self._runtime = runtime
        self._buffers: dict[Any, tuple[int, np.ndarray]] = {}
        # Outgrown buffers stay allocated until clear(): arrays handed out by
        # pinned_input() may still view them.
        self._retired: list[tuple[int, np.ndarray]] = []

    def get(self, slot: Any, nbytes: int) -> np.ndarray:
        entry = self._buffers.get(slot)
        if entry is None or entry[1].nbytes < nbytes:
            if entry is not None:
                self._retired.append(entry)
            capacity = pinned.rounded_capacity(nbytes)
            pointer = self._runtime.hostAlloc(capacity, 0)
            entry = (pointer, np.frombuffer(memoryview((ctypes.c_uint8 * capacity).from_address(pointer)).cast("B"), np.uint8))
            self._buffers[slot] = entry
        return entry[1][:nbytes]

    def adopt_user_buffers(self, other: PinnedBuffers) -> None:
        """Take over the buffers `other` handed out through pinned_input() (and
        its outgrown ones, which such arrays may still view): they stay
        allocated, and their slots the same, until this one's clear(). Its own
        staging buffers are left to `other` to free."""
        for slot, entry in list(other._buffers.items()):
            if isinstance(slot, tuple) and slot and slot[0] == "user":
                del other._buffers[slot]
                if slot in self._buffers:
                    self._retired.append(entry)
                else:
                    self._buffers[slot] = entry
        self._retired.extend(other._retired)
        other._retired.clear()

    def owns(self, array: np.ndarray) -> bool:
        """Whether `array` lies inside one of these buffers (then no staging copy is needed)."""
        start = array.ctypes.data
        entries = [*self._buffers.values(), *self._retired]
        return any(pointer <= start and start + array.nbytes <= pointer + buffer.nbytes for pointer, buffer in entries)

    def clear(self) -> None:
        for pointer, _ in [*self._buffers.values(), *self._retired]:
            self._runtime.freeHost(pointer)
        self._buffers.clear()
        self._retired.clear()


class DeviceBuffers:
    """Reusable device buffers for inputs, one per slot, grown to powers of two.

    Reuse is safe because every run synchronizes its stream before returning."""

    def __init__(self, runtime: Any):
        self._runtime = runtime
        self._buffers: dict[Any, tuple[int, int]] = {}

    def get(self, slot: Any, nbytes: int) -> int:
        pointer, capacity = self._buffers.get(slot, (0, 0))
        if capacity < nbytes or not pointer:
            if pointer:
                self._runtime.free(pointer)
            capacity = pinned.rounded_capacity(nbytes)
            pointer = self._runtime.malloc(capacity)
            self._buffers[slot] = (pointer, capacity)
        return pointer

    def clear(self) -> None:
        for pointer, _ in self._buffers.values():
            self._runtime.free(pointer)
        self._buffers.clear()


def load_weights_on_cuda(device_index: int, container: Container, weights: memoryview) -> None:
    """Feed the blob straight from the bundle mapping, registered read-only as
    pinned memory when the driver allows it (about 2.4x faster on the H200
    machine than passing the pageable mapping; docs/benchmarks.md)."""
    use_device(device_index)
    runtime = cuda_runtime()
    address, size = buffer_address(weights), weights.nbytes
    registered = False
    if size:
        try:
            runtime.hostRegister(address, size, HOST_REGISTER_READ_ONLY)
            registered = True
        except runtime.CUDARuntimeError:
            pass  # a plain pageable copy: slower but correct
    try:
        container.load_weights(address, size)
        runtime.deviceSynchronize()
    finally:
        if registered:
            runtime.hostUnregister(address)


class CudaExecutor(Executor):
    """One lane of a method on a GPU: its own stream, staging buffers and invoker, for one container."""

    def __init__(self, shim: Shim, device_index: int, container: Container, dtypes: Sequence[str], helper: CallHelper | None = None):
        self.runtime = cuda_runtime()
        self.shim = shim
        self.device_index = device_index
        self.container = container
        self.use_device()
        self.stream = Stream(self.runtime, device_index)
        self.pinned = PinnedBuffers(self.runtime)
        self.device_buffers = DeviceBuffers(self.runtime)
        self._invoker: Invoker = make_invoker(helper, shim, container, dtypes, shim.device_cuda, device_index, self.stream.ptr)
        self._cupy_module: Any = None
        self._cupy_cuda: Any = None
        self._cupy_ndarray: Any = None
        self._cupy_dtypes: dict[str, tuple[np.dtype, int]] = {}
        self._device_call: Any = None

    @property
    def cupy(self) -> Any:
        if self._cupy_module is None:
            cupy = _cupy()
            # Looked up once: run_device makes a CuPy array per output per call.
            self._cupy_cuda, self._cupy_ndarray = cupy.cuda, cupy.ndarray
            self._device_call = self._make_device_call(cupy)
            self._cupy_module = cupy
        return self._cupy_module

    def _make_device_call(self, cupy: Any) -> Any:
        """run_device's calls made in C, where the invoker has them (see invoke.py)."""
        dtypes = {}
        for code, name in self.shim.dtype_names.items():
            with contextlib.suppress(ModelRuntimeError):  # no CuPy array of it: an output of it is refused
                dtypes[code] = self._device_dtype(name)
        native = self._invoker.device_call(cupy.ndarray, cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer, dtypes)
        if native is not None:
            self.stream.hold()  # outputs it made free their memory on this stream: let go once none is left (close)
        return native

    def use_device(self) -> None:
        if self.runtime.getDevice() != self.device_index:
            self.runtime.setDevice(self.device_index)

    # -- host arrays in, host arrays out --------------------------------------

    def run(self, arrays: list[np.ndarray], phases: dict[str, float] | None = None) -> list[np.ndarray]:
        """Host arrays in and out. With `phases`, CUDA events time the copies in
        (host staging included), the model and the copies out."""
        self.use_device()
        events = _PhaseEvents(self.runtime, self.stream) if phases is not None else None
        _mark(events, "start")
        addresses = [self.upload(index, array) for index, array in enumerate(arrays)]
        _mark(events, "uploaded")
        owned, views = self._run([(address, array.shape) for address, array in zip(addresses, arrays)])
        try:
            _mark(events, "computed")
            staged = [self._download_output(index, view) for index, view in enumerate(views)]
            _mark(events, "downloaded")
            self.stream.synchronize()
            if events is not None and phases is not None:
                phases.update(events.phases())
            return [result if pooled else gather(result, view) for (result, pooled), view in zip(staged, views)]
        except BaseException:
            with contextlib.suppress(Exception):
                self.stream.synchronize()  # no copy may still read what is released next
            raise
        finally:
            owned.release()
            if events is not None:
                events.destroy()

    def pinned_input(self, index: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """The pinned staging buffer of input `index` as an array. Filling it and
        passing it to run() skips the host-side staging copy."""
        dtype_ = numpy_dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype_.itemsize
        # Its own slot: the staging buffer of input `index` is overwritten by
        # any run given an ordinary array, and must not be the user's array.
        return self.pinned.get(("user", index), nbytes).view(dtype_).reshape(shape)

    def upload(self, index: int, array: np.ndarray, destination: int | None = None) -> int:
        """Queue the copy of input `index` to the device (into `destination`, or
        this executor's buffer for it) through pinned staging; returns the address."""
        if not array.dtype.isnative:  # the device reads native byte order; the CPU path converts the same way
            array = array.astype(array.dtype.newbyteorder("="))
        nbytes = array.nbytes
        device = self.device_buffers.get(index, nbytes) if destination is None else destination
        if nbytes:
            # A pinned array is always a view (of a staging or pooled buffer): a
            # base-less array needs no search through the buffers.
            if array.base is not None and array.flags.c_contiguous and (self.pinned.owns(array) or _is_pooled(array)):
                source = array.ctypes.data  # already pinned: the DMA engine reads it directly
            elif nbytes >= pinned.PIPELINE_MIN_BYTES:
                staging = self.pinned.get(("in", index), nbytes)
                pinned.staged_upload(self.runtime, self.stream.ptr, device, np.ascontiguousarray(array), staging, HOST_TO_DEVICE)
                return device
            else:
                staging = self.pinned.get(("in", index), nbytes)
                np.copyto(staging.reshape(-1), np.ascontiguousarray(array).reshape(-1).view(np.uint8))
                source = staging.ctypes.data
            self.runtime.memcpyAsync(device, source, nbytes, HOST_TO_DEVICE, self.stream.ptr)
        return device

    def _run(self, inputs: list[tuple[int, tuple[int, ...]]]) -> tuple[OwnedHandles, list[TensorView]]:
        return self._invoker([(address, shape, contiguous_strides(shape)) for address, shape in inputs])

    def _download_output(self, index: int, view: TensorView) -> tuple[np.ndarray, bool]:
        """Queue an output's copy to the host. A large contiguous output lands in a
        pooled pinned buffer that becomes the result itself (True); others in
        staging, to be gathered into a fresh array after the copy (False)."""
        dtype = numpy_dtype(view.dtype)
        nbytes = view.numel * dtype.itemsize
        if not view.contiguous or nbytes < pinned.POOLED_MIN_BYTES:
            return self.download(index, view), False
        buffer = pinned.output_pool(self.runtime).array(nbytes)
        self.runtime.memcpyAsync(buffer.ctypes.data, view.address, nbytes, DEVICE_TO_HOST, self.stream.ptr)
        return buffer.view(dtype).reshape(view.shape), True

    def download(self, index: int, view: TensorView) -> np.ndarray:
        """Queue the copy of an output's whole span into pinned memory; `gather` then reads strided views."""
        nbytes = span_nbytes(view)
        staging = self.pinned.get(("out", index), nbytes)
        if nbytes:
            self.runtime.memcpyAsync(staging.ctypes.data, view.address, nbytes, DEVICE_TO_HOST, self.stream.ptr)
        return staging

    # -- device arrays in, device arrays out ------------------------------------

    def _device_dtype(self, name: str) -> tuple[np.dtype, int]:
        """The CuPy dtype of an output, and its item size (bfloat16 as its uint16 bits)."""
        known = self._cupy_dtypes.get(name)
        if known is None:
            try:
                dtype = _cupy_dtype(name)
            except (InputError, TypeError):
                raise ModelRuntimeError(f"an output has dtype {name}, which run_device cannot return as a device array") from None
            known = self._cupy_dtypes[name] = (dtype, dtype.itemsize)
        return known

    def _device_array(self, view: TensorView, dtype: np.dtype, itemsize: int, owner: Any) -> Any:
        """A CuPy array over an output's memory."""
        cuda = self._cupy_cuda
        if cuda is None:
            cuda = self.cupy.cuda
        memory = cuda.UnownedMemory(view.address, view.span * itemsize, owner, self.device_index)
        # Row-major: CuPy works the strides out itself, faster than they can be passed.
        strides = None if view.contiguous else tuple([stride * itemsize for stride in view.strides])
        return self._cupy_ndarray(view.shape, dtype, cuda.MemoryPointer(memory, 0), strides)

    def device_inputs(self, arrays: Sequence[Any], names: Sequence[str]) -> list[Any]:
        cupy = self.cupy
        ndarray = cupy.ndarray
        for array in arrays:
            if type(array) is not ndarray:
                return [_as_cupy(cupy, name, array) for name, array in zip(names, arrays)]
        return list(arrays)

    def copy_device(self, array: Any) -> Any:
        # On this lane's stream, as the run that reads it (or the caller, after
        # synchronizing `stream`, for an output that is an input): CuPy's current
        # stream is the legacy default one, which a non-blocking stream does not
        # wait for, nor it for that stream's pending writes of the array.
        with self.stream.as_cupy():
            return self.cupy.array(array)

    def run_device(self, arrays: list[Any]) -> list[Any]:
        """CuPy in, CuPy out, no copies. Outputs own their handles: releasing the
        last array that views a handle frees it. Work is ordered on this lane's
        stream; inputs must be ready on it (synchronize the producer's stream)."""
        self.use_device()
        native = self._device_call
        if native is not None and self.container.ready:
            made = native.run(arrays)
            if type(made) is list:
                return made
            if made is not None:
                self._invoker.raise_failure(made, native.failed_index, native.run_status)
            # None: an input it does not take as it is (not row-major, say); the same call in Python
        inputs, layouts = [], []
        for array in arrays:
            array = self.contiguous_device(array)
            inputs.append(array)
            layouts.append((array.data.ptr, array.shape, contiguous_strides(array.shape)))
        owned, views = self._invoker(layouts)
        handles = owned.transfer()
        # Every handle has its keeper before any array is made, so an output that
        # cannot be made (a dtype CuPy lacks) leaves nothing unowned. One keeper
        # per distinct handle: aliased outputs share theirs.
        keepers = {handle: _HandleKeeper(self.shim, handle, self.stream) for handle in dict.fromkeys(handles) if handle}
        spans = [(array.data.ptr, array.nbytes) for array in inputs]
        outputs = []
        for index, (handle, view) in enumerate(zip(handles, views)):
            if not handle:
                raise ModelRuntimeError(f"the model returned no tensor for output {index}")
            dtype, itemsize = self._device_dtype(view.dtype)
            if _views_any(view.address, view.span * itemsize, spans):
                keepers[handle].keep(inputs)
            outputs.append(self._device_array(view, dtype, itemsize, keepers[handle]))
        return outputs

    def _contiguous(self, array: Any) -> Any:
        with self.stream.as_cupy():
            return self.cupy.ascontiguousarray(array)

    def contiguous_device(self, array: Any) -> Any:
        """`array` itself where it is row-major, else a row-major copy on this lane's stream."""
        return array if array.flags.c_contiguous else self._contiguous(array)

    def copy_of_output(self, view: TensorView, owner: Any) -> Any:
        """A private CuPy copy, queued on this lane's stream, of the tensor `view`
        describes in memory `owner` keeps (a graph's output buffers)."""
        dtype, itemsize = self._device_dtype(view.dtype)
        return self.copy_device(self._device_array(view, dtype, itemsize, owner))

    def take_over(self, old: Executor) -> None:
        if isinstance(old, CudaExecutor):
            self.pinned.adopt_user_buffers(old.pinned)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.synchronize()
        self.pinned.clear()
        self.device_buffers.clear()
        if self._device_call is not None:
            self._device_call.close(self.stream.let_go)
        self.stream.destroy()


class _PhaseEvents:
    """CUDA events recorded on the lane's stream between the phases of a run."""

    NAMES = ("start", "uploaded", "computed", "downloaded")

    def __init__(self, runtime: Any, stream: Stream):
        self._runtime = runtime
        self._stream = stream
        self._events = {name: runtime.eventCreate() for name in self.NAMES}

    def mark(self, name: str) -> None:
        self._runtime.eventRecord(self._events[name], self._stream.ptr)

    def phases(self) -> dict[str, float]:
        elapsed = self._runtime.eventElapsedTime
        events = self._events
        return {
            "copy_in": elapsed(events["start"], events["uploaded"]) / 1e3,
            "compute": elapsed(events["uploaded"], events["computed"]) / 1e3,
            "copy_out": elapsed(events["computed"], events["downloaded"]) / 1e3,
        }

    def destroy(self) -> None:
        for event in self._events.values():
            self._runtime.eventDestroy(event)


def _mark(events: _PhaseEvents | None, name: str) -> None:
    if events is not None:
        events.mark(name)


class _HandleKeeper:
    """Owner of one output handle behind CuPy arrays; deletes it when the last
    array viewing it is collected (CuPy's UnownedMemory holds this owner).

    An output that views an input's memory also keeps the run's inputs alive
    (`keep`); the others do not, so that an output fed back in as the next
    call's input does not keep every earlier one.
    """

    __slots__ = ("_delete", "_handle", "_inputs", "_stream")

    def __init__(self, shim: Shim, handle: int, stream: Stream):
        self._delete = shim.delete_tensor_object
        self._handle = handle
        self._inputs: list[Any] | None = None
        self._stream = stream
        stream.hold()  # its memory is freed on this stream: it must still exist then

    def keep(self, inputs: list[Any]) -> None:
        self._inputs = inputs

    def __del__(self) -> None:
        try:
            self._delete(self._handle)
        finally:
            self._stream.let_go()


def _views_any(address: int, nbytes: int, spans: list[tuple[int, int]]) -> bool:
    """Whether the bytes [address, address + nbytes) meet any of `spans` (address, length)."""
    return nbytes > 0 and any(length > 0 and address < start + length and start < address + nbytes for start, length in spans)


def _is_pooled(array: np.ndarray) -> bool:
    """Whether `array` views a pooled pinned output (passing an output back in skips staging)."""
    base: Any = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, pinned.PinnedArrayOwner)


def _as_cupy(cupy: Any, name: str, array: Any) -> Any:
    if isinstance(array, cupy.ndarray):
        return array
    if not hasattr(array, "__cuda_array_interface__"):
        raise InputError(f"input {name!r} is not a CUDA array (CuPy, or anything with __cuda_array_interface__)")
    return cupy.asarray(array)


def _cupy_dtype(name: str) -> np.dtype:
    return np.dtype(np.uint16) if name == "bfloat16" else numpy_dtype(name)

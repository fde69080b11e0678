"""One model call: wrap the inputs as tensor handles, Run, read the outputs.

Two ways to do it, with the same result:

- `HelperInvoker` makes one foreign call per model call, into the call
  helper (cuda_runner/native/call_helper.c), which a bundle carries as a
  digested segment. The frame it fills is made once per lane; a call only
  writes the input addresses, and the sizes and strides when they change.
- `CtypesInvoker` crosses into C once per input, once for Run and five times
  per output. It is used for bundles without a helper, for ExecuTorch
  programs, and when the helper is turned off (`call_helper=False`).

Thread safety: an invoker belongs to one executor (lane), which serves one
call at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..errors import BundleError, ModelRuntimeError
from ..format.manifest import MethodSpec
from ..format.source import ModelReader
from .container import Container
from .library import LibraryLease, lease_library
from .shim import Int64Pointer as _I64P
from .shim import Shim
from .tensors import Describer, OwnedHandles, TensorView, contiguous_strides, wrap_memory

#: (address, shape, strides in elements) of each input, in the library's order.
InputLayout = tuple[int, tuple[int, ...], tuple[int, ...]]

HELPER_ABI = 1
# Status codes of cuda_runner_call.
_WRAP_FAILED, _RUN_FAILED, _DESCRIBE_FAILED = 1, 2, 3


class _Input(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("sizes", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("ndim", ctypes.c_int64), ("dtype", ctypes.c_int32), ("reserved", ctypes.c_int32)]


class _Output(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_void_p), ("data", ctypes.c_void_p), ("sizes", _I64P), ("strides", _I64P),
                ("ndim", ctypes.c_int64), ("numel", ctypes.c_int64), ("span", ctypes.c_int64),
                ("dtype", ctypes.c_int32), ("contiguous", ctypes.c_int32)]


class _Frame(ctypes.Structure):
    _fields_ = [("run", ctypes.c_void_p), ("container", ctypes.c_void_p), ("stream", ctypes.c_void_p),
                ("inputs", ctypes.c_void_p), ("outputs", ctypes.c_void_p),
                ("input_handles", ctypes.c_void_p), ("output_handles", ctypes.c_void_p),
                ("input_count", ctypes.c_int64), ("output_count", ctypes.c_int64),
                ("device_type", ctypes.c_int32), ("device_index", ctypes.c_int32),
                ("run_status", ctypes.c_int32), ("failed_index", ctypes.c_int32)]


class CallHelper:
    """A loaded call helper: its library lease and its one entry point."""

    def __init__(self, lease: LibraryLease, call: Callable[[int], int]):
        self.lease = lease
        self.call = call

    def release(self) -> None:
        self.lease.release()


def load_call_helper(reader: ModelReader, spec: MethodSpec, prepare: Callable[[bytes], bytes | bytearray] = bytes) -> tuple[CallHelper | None, str]:
    """The method's call helper, checked like a library before it is loaded.

    The helper is optional, so where it cannot serve here (another ABI, or a
    library this machine cannot load) the method runs through ctypes: None,
    with the reason. A helper that fails its digest, is no shared library at
    all, or claims this ABI with other structures refuses the bundle."""
    assert spec.call_helper_segment is not None
    name = spec.call_helper_segment
    data = reader.read_verified(name)  # code: always checked before it is loaded
    if data[:4] != b"\x7fELF":
        raise BundleError(f"method {spec.name!r}: segment {name!r} is not a shared library, so not a call helper")
    try:
        lease = lease_library(prepare(data), f"{name}@{reader.path.name}")
    except ModelRuntimeError as error:
        return None, f"ctypes: the call helper cannot be loaded here ({error})"
    try:
        library = lease.library
        abi = library.optional("cuda_runner_call_abi", ())
        if abi is None:
            raise BundleError(f"method {spec.name!r}: segment {name!r} is not a cuda-runner call helper")
        version = abi()
        if version != HELPER_ABI:  # a newer helper may name its entry points differently: look no further
            lease.release()
            return None, f"ctypes: the call helper speaks ABI {version}, this runtime {HELPER_ABI}"
        layout = library.optional("cuda_runner_call_layout", (_I64P,))
        call = library.optional("cuda_runner_call", (ctypes.c_void_p,))
        if layout is None or call is None:
            raise BundleError(f"method {spec.name!r}: the call helper claims ABI {HELPER_ABI} but lacks its entry points")
        layout.restype = None
        sizes = (ctypes.c_int64 * 3)()
        layout(sizes)
        expected = [ctypes.sizeof(_Frame), ctypes.sizeof(_Input), ctypes.sizeof(_Output)]
        if list(sizes) != expected:
            raise BundleError(f"method {spec.name!r}: the call helper's structures ({list(sizes)} bytes) are not ABI {HELPER_ABI}'s ({expected})")
    except BaseException:
        with contextlib.suppress(Exception):
            lease.release()
        raise
    return CallHelper(lease, call), "call helper"


class Invoker:
    """Calls one container for one executor."""

    container: Container

    def __call__(self, inputs: Sequence[InputLayout]) -> tuple[OwnedHandles, list[TensorView]]:
        raise NotImplementedError

    def device_call(self, array_type: type, memory_type: Any, pointer_type: Any, dtypes: dict[int, tuple[Any, int]]) -> Any | None:
        """The same calls made in C for device arrays (cuda_runner/native/device_call.c), or None."""
        return None

    def raise_failure(self, status: int, failed_index: int, run_status: int, printed: str = "") -> NoReturn:
        """Raise for a call that failed with `status` (the call helper's codes)."""
        raise ModelRuntimeError(f"the call failed with status {status}")


def make_invoker(
    helper: CallHelper | None, shim: Shim, container: Container, dtypes: Sequence[str], device_type: int, device_index: int, stream: int | None,
) -> Invoker:
    if helper is None:
        return CtypesInvoker(shim, container, dtypes, device_type, device_index, stream)
    return HelperInvoker(helper, shim, container, dtypes, device_type, device_index, stream)


class CtypesInvoker(Invoker):
    def __init__(self, shim: Shim, container: Container, dtypes: Sequence[str], device_type: int, device_index: int, stream: int | None):
        self.container = container
        self._shim = shim
        self._dtypes = list(dtypes)
        self._device = (device_type, device_index)
        self._stream = stream
        self._describe = Describer(shim)

    def __call__(self, inputs: Sequence[InputLayout]) -> tuple[OwnedHandles, list[TensorView]]:
        # Input handles go straight into slots that free them if anything stops
        # the call before Run, which steals them (and nulls the slots).
        given = OwnedHandles(self._shim, count=self.container.num_inputs)
        for index, (dtype, (address, shape, strides)) in enumerate(zip(self._dtypes, inputs)):
            wrap_memory(self._shim, address, dtype, shape, strides, *self._device, into=(given.slots, index))
        owned = OwnedHandles(self._shim, count=self.container.num_outputs)
        self.container.run(given.handles, self._stream, outputs=owned.slots, inputs_array=given.slots)
        try:
            return owned, [self._describe(handle) for handle in owned.handles]
        except BaseException:
            owned.release()
            raise


class HelperInvoker(Invoker):
    def __init__(
        self, helper: CallHelper, shim: Shim, container: Container, dtypes: Sequence[str], device_type: int, device_index: int, stream: int | None,
    ):
        self.container = container
        self._shim = shim
        self._call = helper.call
        inputs, outputs = container.num_inputs, container.num_outputs
        self._inputs = (_Input * max(1, inputs))()
        self._outputs = (_Output * max(1, outputs))()
        self._input_handles = (ctypes.c_void_p * max(1, inputs))()
        # One set of output slots for every call (a lane makes one call at a time):
        # each call's caller takes the handles out of them, or they are freed.
        self._owned = OwnedHandles(shim, count=outputs)
        self._input_count, self._output_count = inputs, outputs
        self._frame = _Frame(
            run=container.run_address, container=container.handle_address, stream=stream or None,
            inputs=ctypes.addressof(self._inputs), outputs=ctypes.addressof(self._outputs),
            input_handles=ctypes.addressof(self._input_handles), output_handles=ctypes.addressof(self._owned.slots),
            input_count=inputs, output_count=outputs, device_type=device_type, device_index=device_index,
        )
        self._address = ctypes.addressof(self._frame)
        self._input_items = [self._inputs[index] for index in range(inputs)]
        self._output_items = [self._outputs[index] for index in range(outputs)]
        for item, dtype in zip(self._input_items, dtypes):
            item.dtype = shim.dtype_codes[dtype]
        # The sizes and strides each input slot points at, kept alive here.
        self._layouts: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = [None] * inputs
        self._dims: list[tuple[ctypes.Array, ctypes.Array] | None] = [None] * inputs
        self._dtype_names = shim.dtype_names
        self._capture = container.capture_errors and not container.reports_errors

    def __call__(self, inputs: Sequence[InputLayout]) -> tuple[OwnedHandles, list[TensorView]]:
        if not self.container.ready:
            raise ModelRuntimeError("weights must be loaded before Run")
        if len(inputs) != self._input_count:  # a short list would leave the last call's addresses in the frame
            raise ModelRuntimeError(f"internal error: {len(inputs)} inputs for {self._input_count}")
        items, layouts = self._input_items, self._layouts
        for index, (address, shape, strides) in enumerate(inputs):
            items[index].data = address
            if layouts[index] != (shape, strides):
                self._set_layout(index, shape, strides)
        # Run writes the output handles straight into `owned`: ours from the moment they exist.
        owned = self._owned
        owned.reclaim()
        try:  # from the call on: an interrupt right after it returns (Ctrl-C is raised there) frees its outputs now
            if self._capture:
                status, printed = self.container.guarded(lambda: self._call(self._address))
            else:
                status, printed = self._call(self._address), ""
            if status != 0:
                self._raise(status, printed, owned)
            return owned, [self._view(item) for item in self._output_items]
        except BaseException:
            owned.release()
            raise

    def _view(self, item: _Output) -> TensorView:
        """One output as the helper described it (it worked out every figure in C).
        A row-major output's strides are the canonical ones (size-1 dims aside,
        whose strides address nothing), so they are not read back."""
        rank, code, contiguous = item.ndim, item.dtype, item.contiguous != 0
        shape = tuple(item.sizes[:rank])
        strides = contiguous_strides(shape) if contiguous else tuple(item.strides[:rank])
        return TensorView(item.data or 0, self._dtype_names.get(code) or f"code {code}", shape, strides, item.numel, item.span, contiguous)

    def _set_layout(self, index: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
        sizes = (ctypes.c_int64 * max(1, len(shape)))(*shape)
        steps = (ctypes.c_int64 * max(1, len(strides)))(*strides)
        item = self._input_items[index]
        item.sizes, item.strides, item.ndim = ctypes.addressof(sizes), ctypes.addressof(steps), len(shape)
        self._dims[index] = (sizes, steps)
        self._layouts[index] = (shape, strides)

    def device_call(self, array_type: type, memory_type: Any, pointer_type: Any, dtypes: dict[int, tuple[Any, int]]) -> Any | None:
        """This invoker's calls made in C, for arrays of `array_type` on the
        device (cuda_runner/native/device_call.c, with its own frame): None
        where that module is not built, or where what a failing library
        prints must be caught around the call (which only Python does)."""
        if self._capture:
            return None
        try:
            from .. import _device_call
        except ImportError:
            return None
        if _device_call.layout() != (ctypes.sizeof(_Frame), ctypes.sizeof(_Input), ctypes.sizeof(_Output)):
            return None  # built from another version of the structures: the Python path is right
        frame, delete = self._frame, self._shim.delete_tensor_object
        return _device_call.DeviceCall(
            helper=_address_of(self._call), run=frame.run, container=frame.container, stream=frame.stream,
            device_type=frame.device_type, device_index=frame.device_index, input_dtypes=[item.dtype for item in self._input_items],
            output_count=self._output_count, delete=_address_of(delete), array_type=array_type,
            memory_type=memory_type, pointer_type=pointer_type, dtypes=dtypes, keep=delete, error=ModelRuntimeError,
        )

    def _raise(self, status: int, printed: str, owned: OwnedHandles) -> NoReturn:
        if status == _DESCRIBE_FAILED:
            owned.release()
        self.raise_failure(status, self._frame.failed_index, self._frame.run_status, printed)

    def raise_failure(self, status: int, failed_index: int, run_status: int, printed: str = "") -> NoReturn:
        if status == _WRAP_FAILED:
            self._shim.check(status, f"create an input tensor handle (input {failed_index})")
        if status == _RUN_FAILED:
            self.container.check_run(run_status, printed)
        if status == _DESCRIBE_FAILED:
            raise ModelRuntimeError(self._shim.failure(f"read an output tensor's metadata (output {failed_index})"))
        raise ModelRuntimeError(f"the call helper returned an unknown status {status}")


def _address_of(function: Any) -> int:
    """The address of a ctypes foreign function."""
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0)

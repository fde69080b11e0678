"""Tensor handles: non-owning views of our memory in, owned outputs out."""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import numpy as np

from ..arrays import numpy_dtype
from .shim import Handle, Shim
from .shim import Int64Pointer as _I64P


class TensorView(NamedTuple):
    """What an output handle points at: address, shape and strides in elements,
    with the figures every use needs. (A named tuple: one is made per output
    of every call, and it costs less than a dataclass; the call helper works
    the figures out in C.)"""

    address: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    numel: int
    span: int  # elements from the first one addressed to one past the last (0 when empty)
    contiguous: bool  # row-major, ignoring the strides of size-1 dims

    @classmethod
    def of(cls, address: int, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...]) -> TensorView:
        numel = 1
        for size in shape:
            numel *= size
        span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides)) if numel else 0
        contiguous, expected = True, 1
        for size, stride in zip(reversed(shape), reversed(strides)):
            if size != 1 and stride != expected:
                contiguous = False
                break
            expected *= size
        return cls(address, dtype, shape, strides, numel, span, contiguous)


_DIMS_CACHE: dict[tuple[int, ...], ctypes.Array] = {}
_DIMS_CACHE_LIMIT = 1024


def _dims_array(values: tuple[int, ...]) -> ctypes.Array:
    """A C int64 array for sizes or strides, cached: the same shapes recur every call,
    and the shim copies them, so sharing one array between calls is safe."""
    array = _DIMS_CACHE.get(values)
    if array is None:
        if len(_DIMS_CACHE) >= _DIMS_CACHE_LIMIT:
            _DIMS_CACHE.clear()
        array = _DIMS_CACHE[values] = (ctypes.c_int64 * max(1, len(values)))(*values)
    return array


def wrap_memory(
    shim: Shim, address: int, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...], device_type: int, device_index: int,
    storage_offset: int = 0, into: tuple[ctypes.Array, int] | None = None,
) -> int:
    """A handle viewing memory we own; the library steals the handle, not the memory.
    `into` (slots, index): written straight into an owner's slot, so that no
    moment exists where the handle is nobody's."""
    handle = Handle()
    target: object = ctypes.byref(handle)
    if into is not None:
        target = ctypes.cast(ctypes.addressof(into[0]) + into[1] * ctypes.sizeof(Handle), ctypes.POINTER(Handle))
    status = shim.create_tensor_from_blob_v2(
        address, len(shape), _dims_array(shape), _dims_array(strides), storage_offset, shim.dtype_codes[dtype],
        device_type, device_index, target, shim.layout_strided, None, 0,
    )
    if status != 0:
        shim.check(status, "create an input tensor handle")
    return int((into[0][into[1]] if into is not None else handle.value) or 0)


@functools.lru_cache(maxsize=1024)  # the same shapes recur on every call
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def gather(span: np.ndarray, view: TensorView) -> np.ndarray:
    """A fresh C-contiguous array of `view`, from a byte array holding its whole span."""
    dtype = numpy_dtype(view.dtype)
    if view.numel == 0:
        return np.empty(view.shape, dtype)
    base = span.view(dtype)
    if view.contiguous:
        return base[: view.numel].reshape(view.shape).copy()
    strided = np.lib.stride_tricks.as_strided(base, view.shape, tuple(stride * dtype.itemsize for stride in view.strides))
    return np.array(strided, copy=True, order="C")


def span_nbytes(view: TensorView) -> int:
    return view.span * numpy_dtype(view.dtype).itemsize


class Describer:
    """Reads output handles. The ctypes out-parameters are made once and reused:
    this runs for every output of every call."""

    def __init__(self, shim: Shim):
        self._shim = shim
        self._address = ctypes.c_void_p()
        self._ndim = ctypes.c_int64()
        self._sizes = _I64P()
        self._strides = _I64P()
        self._dtype = ctypes.c_int32()
        self._refs = [ctypes.byref(value) for value in (self._address, self._ndim, self._sizes, self._strides, self._dtype)]
        self._calls = (shim.get_data_ptr, shim.get_dim, shim.get_sizes, shim.get_strides, shim.get_dtype)

    def __call__(self, handle: int) -> TensorView:
        for call, ref in zip(self._calls, self._refs):
            if call(handle, ref) != 0:
                self._shim.check(1, "read an output tensor's metadata")
        rank = self._ndim.value
        return TensorView.of(
            self._address.value or 0, self._shim.dtype_names.get(self._dtype.value, f"code {self._dtype.value}"),
            tuple(self._sizes[:rank]), tuple(self._strides[:rank]),
        )


@functools.cache
def _slots_type(count: int) -> type[ctypes.Array]:
    return Handle * count


class OwnedHandles:
    """Output handles of one Run: each distinct handle deleted exactly once.

    The slots exist before the native call that fills them (`slots`), so an
    interrupt (Ctrl-C lands between any two Python bytecodes) can never leave a
    handle that nothing owns: whatever is in the slots when this object goes is
    freed. Two outputs can be the same handle (aliased outputs), so deletion
    goes by handle value, not by output position.
    """

    # One is made per call: slots, and no more work than the ownership needs.
    __slots__ = ("_capacity", "_count", "_delete", "slots")

    def __init__(self, shim: Shim, handles: list[int] | None = None, *, count: int = 0):
        self._count = 0  # until the slots exist
        self._delete = shim.delete_tensor_object
        if handles is None:
            self.slots = _slots_type(max(1, count))()
        else:
            count = len(handles)
            self.slots = _slots_type(max(1, count))(*handles)
        self._count = self._capacity = count

    @property
    def handles(self) -> list[int]:
        return [handle or 0 for handle in self.slots[:self._count]]

    def transfer(self) -> list[int]:
        """Hand the handles, in output order (0 where there is none), to a new
        owner; this object frees nothing after. Aliased outputs repeat a handle."""
        handles = self.handles
        self._count = 0  # the slots keep the values, but none is this object's any more
        return handles

    def release(self) -> None:
        slots, count = self.slots, self._count
        for index in range(count):
            handle = slots[index]
            if handle:
                for other in range(index, count):  # an aliased output: once
                    if slots[other] == handle:
                        slots[other] = None
                self._delete(handle)
        self._count = 0

    def reclaim(self) -> ctypes.Array:
        """Own the slots again, empty, for the next Run to fill: what a caller
        interrupted before taking its handles left in them is freed first.
        (An invoker keeps one of these for all its calls, one call at a time.)"""
        if self._count:
            self.release()
        slots = self.slots
        for index in range(len(slots)):
            slots[index] = None
        self._count = self._capacity
        return slots

    def __del__(self) -> None:
        if self._count:
            self.release()

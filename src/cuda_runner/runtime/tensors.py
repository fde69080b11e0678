"""Tensor handles: non-owning views of our memory in, owned outputs out."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .shim import Handle, Shim

_I64P = ctypes.POINTER(ctypes.c_int64)


@dataclass(frozen=True)
class TensorView:
    """What an output handle points at: address, shape and strides in elements."""

    address: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    device_type: int

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def span_elements(self) -> int:
        """Elements from the first to one past the last one addressed."""
        if self.numel == 0:
            return 0
        return 1 + sum((size - 1) * stride for size, stride in zip(self.shape, self.strides))


def wrap_memory(shim: Shim, address: int, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...], device_type: int, device_index: int) -> int:
    """A handle viewing memory we own; the library steals the handle, not the memory."""
    ndim = len(shape)
    sizes = (ctypes.c_int64 * max(1, ndim))(*shape)
    element_strides = (ctypes.c_int64 * max(1, ndim))(*strides)
    handle = Handle()
    shim.check(
        shim.create_tensor_from_blob_v2(
            ctypes.c_void_p(address), ndim, sizes, element_strides, 0, shim.dtype_codes[dtype],
            device_type, device_index, ctypes.byref(handle), shim.layout_strided, None, 0,
        ),
        "create an input tensor handle",
    )
    return handle.value


def describe(shim: Shim, handle: int) -> TensorView:
    address = ctypes.c_void_p()
    ndim = ctypes.c_int64()
    sizes = _I64P()
    strides = _I64P()
    dtype = ctypes.c_int32()
    device_type = ctypes.c_int32()
    shim.check(shim.get_data_ptr(handle, ctypes.byref(address)), "read an output's data pointer")
    shim.check(shim.get_dim(handle, ctypes.byref(ndim)), "read an output's rank")
    shim.check(shim.get_sizes(handle, ctypes.byref(sizes)), "read an output's sizes")
    shim.check(shim.get_strides(handle, ctypes.byref(strides)), "read an output's strides")
    shim.check(shim.get_dtype(handle, ctypes.byref(dtype)), "read an output's dtype")
    shim.check(shim.get_device_type(handle, ctypes.byref(device_type)), "read an output's device")
    rank = ndim.value
    return TensorView(
        address=address.value or 0,
        dtype=shim.dtype_names.get(dtype.value, f"code {dtype.value}"),
        shape=tuple(sizes[index] for index in range(rank)),
        strides=tuple(strides[index] for index in range(rank)),
        device_type=device_type.value,
    )


class OwnedHandles:
    """Output handles of one Run: each distinct handle deleted exactly once.

    Two outputs can be the same handle (aliased outputs), so deletion goes by
    handle value, not by output position.
    """

    def __init__(self, shim: Shim, handles: list[int]):
        self._shim = shim
        self.handles = handles
        self._pending = {handle for handle in handles if handle}

    def transfer(self) -> set[int]:
        """Hand the distinct handles to a new owner; this object frees nothing after."""
        pending, self._pending = self._pending, set()
        return pending

    def release(self) -> None:
        pending, self._pending = self._pending, set()
        for handle in pending:
            self._shim.delete_tensor_object(handle)

    def __del__(self) -> None:
        self.release()

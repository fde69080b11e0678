"""Binding a constant table (format feature `constant-table`) to a container.

A library built with per-constant weights (ExecuTorch 1.5's CUDA programs)
has no weights blob to feed. Each constant is found by its original name
(FQN), checked against the library's own record of it, copied once into
memory owned here (the device's for CUDA constants), wrapped as a tensor view
and handed over with UpdateUserManagedConstantBufferPairs, the one binding
call that libraries from torch 2.10 on all have. The library keeps its own
handle to each tensor but not the memory: a `ConstantMemory` must outlive
the container.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from ..arrays import SCALAR_TYPE_CODES, itemsize
from ..errors import BundleError
from ..format.manifest import ConstantSpec, constant_span_bytes
from . import interrupts
from .container import Container
from .devices import Device
from .host import aligned_empty
from .shim import Shim
from .tensors import wrap_memory
from .upload import Progress, wait_for_releases


class ConstantMemory:
    """The storages a container's constants view; release after deleting the container."""

    def __init__(self) -> None:
        self.storages: dict[tuple[str, str], int] = {}  # (segment name, device type) -> address
        self._host: list[np.ndarray] = []
        self._device: list[tuple[int, int]] = []  # (device index, pointer) of each allocation, to free
        self._device_of: dict[tuple[str, str], int] = {}  # the device a GPU storage is on

    def keep_host(self, array: np.ndarray) -> int:
        self._host.append(array)
        return int(array.ctypes.data)

    def keep_device(self, index: int, pointer: int) -> int:
        self._device.append((index, pointer))
        return pointer

    def place_on_device(self, key: tuple[str, str], index: int, address: int) -> None:
        """A storage at `address` of an allocation kept with keep_device."""
        self.storages[key] = address
        self._device_of[key] = index

    def reload(self, constants: Sequence[ConstantSpec], segment: Callable[[str], memoryview]) -> None:
        """Copy the stored bytes of these constants' storages again (state back to its initial values)."""
        for key in sorted({(constant.segment, constant.device) for constant in constants}):
            address = self.storages.get(key)
            if address is None:
                continue
            source = segment(key[0])
            if key[1] == "cuda":
                from .cuda import HOST_TO_DEVICE, cuda_runtime
                from .host import buffer_address

                wait_for_releases()  # no copy from the mapping while the driver lets its pages go
                runtime = cuda_runtime()
                runtime.setDevice(self._device_of[key])
                runtime.deviceSynchronize()  # no run may still read or write it
                if source.nbytes:
                    runtime.memcpy(address, buffer_address(source), source.nbytes, HOST_TO_DEVICE)
            else:
                kept = next(array for array in self._host if int(array.ctypes.data) == address)
                kept[...] = np.frombuffer(source, dtype=np.uint8)

    def release(self) -> None:
        wait_for_releases()  # the uploads' registrations of the mapping, before it may close
        if self._device:
            from .cuda import cuda_runtime

            runtime = cuda_runtime()
            for index, pointer in self._device:
                runtime.setDevice(index)
                runtime.free(pointer)
        self._device.clear()
        self._device_of.clear()
        self._host.clear()
        self.storages.clear()


def bind_constants(
    container: Container, device: Device, shim: Shim, constants: Sequence[ConstantSpec], segment: Callable[[str], memoryview],
    memory: ConstantMemory | None = None, progress: Progress | None = None,
) -> ConstantMemory:
    """Bind `constants`, copying their storages into `memory` (new if None;
    storages already there, from another method, are used as they are).
    `progress(done, total)` hears how many bytes of the new storages are up."""
    shared = memory is not None
    memory = memory if memory is not None else ConstantMemory()
    handles: list[int] = []
    try:
        internal = _copy_while_matching_names(memory, container, constants, device, segment, progress)
        pairs = []
        for constant in constants:
            address = memory.storages[(constant.segment, constant.device)]
            on_cuda = constant.device == "cuda"
            handle = wrap_memory(
                shim, address, constant.dtype, constant.sizes, constant.strides,
                shim.device_cuda if on_cuda else shim.device_cpu, device.index if on_cuda else 0, constant.storage_offset,
            )
            handles.append(handle)
            pairs += [(name, handle) for name in internal[constant.fqn]]
        # The library takes a handle of its own to each constant and never lets
        # it go: released after the container (shim.capture).
        with shim.capture(container.release_after_delete):
            container.bind_constants(pairs)
    except BaseException:
        if not shared:
            memory.release()
        raise
    finally:
        for handle in handles:  # the library made its own handles; ours go
            shim.delete_tensor_object(handle)
    return memory


def _copy_while_matching_names(
    memory: ConstantMemory, container: Container, constants: Sequence[ConstantSpec], device: Device,
    segment: Callable[[str], memoryview], progress: Progress | None,
) -> dict[str, list[str]]:
    """Copy the storages (_copy_storages) while another thread matches the
    library's names (_internal_names: 16-24 ms on its thread in a 1B decoder's
    0.13 s load on the H200, where the copying threads wait on the driver, not
    on Python). A mismatch is raised after the copy, before what the copy met."""
    matching = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuda-runner-names")
    names: list[Future[dict[str, list[str]]]] = []
    try:
        try:
            with interrupts.held_back():
                names.append(matching.submit(_internal_names, container, constants, segment))
            _copy_storages(memory, constants, device, segment, progress)
        finally:
            # Nothing reads the library or the mapping once this returns: a failed load lets them go.
            # The task is waited for, not the thread: an interrupted Thread.join() takes the thread
            # for ended while it runs (Python 3.11), and a second join then returns at once.
            interrupts.finish_through(lambda: wait(names))  # raises the interrupt it met, once done
    except Exception as copy_failure:
        mismatch = names[0].exception() if names else None
        if isinstance(mismatch, BundleError):  # weights that do not fit the library are told as that
            raise mismatch from copy_failure
        raise
    finally:
        matching.shutdown(wait=True)  # its one task done: the thread ends at once
    return names[0].result()


def _internal_names(container: Container, constants: Sequence[ConstantSpec], segment: Callable[[str], memoryview]) -> dict[str, list[str]]:
    """The library's internal names for each listed FQN, after checking that the
    table and the library agree on which constants there are and their dtypes."""
    by_fqn: dict[str, list[str]] = collections.defaultdict(list)
    dtypes: dict[str, set[int]] = collections.defaultdict(set)
    sizes: dict[str, int] = collections.defaultdict(int)
    for info in container.constants():
        if not info.folded:
            by_fqn[info.fqn].append(info.name)
            dtypes[info.fqn].add(info.dtype_code)
            sizes[info.fqn] = max(sizes[info.fqn], info.nbytes)
    listed = {constant.fqn: constant for constant in constants}
    missing = sorted(set(by_fqn) - set(listed))
    if missing:
        raise BundleError(f"the model library has constants the weights do not supply: {', '.join(repr(name[:80]) for name in missing[:5])}")
    extra = sorted(set(listed) - set(by_fqn))
    if extra:
        raise BundleError(f"the weights supply constants the model library does not have: {', '.join(repr(name[:80]) for name in extra[:5])}")
    for fqn, constant in listed.items():
        if dtypes[fqn] != {SCALAR_TYPE_CODES[constant.dtype]}:
            raise BundleError(f"constant {fqn[:80]!r} is {constant.dtype} in the weights but has dtype code(s) {sorted(dtypes[fqn])} in the model library")
        # The library reads as many bytes as it was built for (its storage, as
        # ExecuTorch checks it), whatever the view says.
        # It reads them from the view's first element: the storage offset counts.
        stored = segment(constant.segment).nbytes
        start = constant.storage_offset * itemsize(constant.dtype)
        if start + sizes[fqn] > stored or constant_span_bytes(constant) > stored:
            raise BundleError(
                f"constant {fqn[:80]!r} starts {start} bytes into a storage of {stored} bytes, and the model library reads {sizes[fqn]} bytes from there")
    return by_fqn


def _copy_storages(memory: ConstantMemory, constants: Sequence[ConstantSpec], device: Device, segment: Callable[[str], memoryview],
                   progress: Progress | None) -> None:
    """Copy each storage segment the constants name, once (constants may share
    one, and one may be wanted on both devices), to where the library wants it:
    the GPU's in one pipelined upload (runtime/upload.py)."""
    wanted = sorted({(constant.segment, constant.device) for constant in constants} - set(memory.storages))
    on_gpu = [key for key in wanted if key[1] == "cuda"]
    for key in wanted:
        if key[1] != "cuda":
            source = segment(key[0])
            copy = aligned_empty((source.nbytes,), np.dtype(np.uint8))
            copy[...] = np.frombuffer(source, dtype=np.uint8)
            memory.storages[key] = memory.keep_host(copy)
    if not on_gpu:
        return
    from .cuda import cuda_runtime
    from .upload import Upload, upload_all

    runtime = cuda_runtime()
    runtime.setDevice(device.index)
    sources: list[memoryview] = []
    try:
        sources += (segment(key[0]) for key in on_gpu)
        # One allocation for all of them, not a cudaMalloc each (181 storages for the 1B decoder).
        offsets, size = _arena_offsets([source.nbytes for source in sources])
        arena = memory.keep_device(device.index, runtime.malloc(max(1, size)))
        for key, offset in zip(on_gpu, offsets):
            memory.place_on_device(key, device.index, arena + offset)
        # The mapping's registrations are let go after the load, off its path; release() waits for that.
        upload_all(runtime, device.index, [Upload(source, arena + offset) for source, offset in zip(sources, offsets)], progress,
                   release_later=True)
    finally:
        for source in sources:  # views of the bundle mapping: none may keep it from closing
            with contextlib.suppress(BufferError):
                source.release()


# Where each storage starts in their shared allocation: cudaMalloc's own alignment, which kernels may assume of a tensor's start.
_STORAGE_ALIGNMENT = 256


def _arena_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each size's offset in one allocation, aligned, and the allocation's size."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-max(size, 1) // _STORAGE_ALIGNMENT) * _STORAGE_ALIGNMENT
    return offsets, end

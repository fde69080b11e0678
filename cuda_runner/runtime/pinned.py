"""Host copies near the link speed: chunked staging in, pooled pinned buffers out.

A copy from an ordinary (pageable) NumPy array to the GPU goes through pinned
memory. For a large array, copying it into pinned staging costs far more than
the DMA itself (about 10 GB/s for one thread, against 54 GB/s pinned on the
H200 machine). So large inputs are copied in chunks by several threads, and
each chunk's DMA is queued as soon as that chunk is staged: the host copies and
the transfers overlap.

Large outputs come back as NumPy arrays that view pinned buffers from a pool:
the DMA writes straight into memory the caller keeps, with no second copy. A
buffer goes back to the pool only when the last array viewing it is gone
(arrays made from an object with `__array_interface__` keep that object as
their base, and so do all their views). Idle pooled memory is bounded.
"""

from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

# Below this, one plain staging copy is faster than handing work to threads.
PIPELINE_MIN_BYTES = 4 << 20
CHUNK_BYTES = 8 << 20
COPY_THREADS = 8
# Pooled output buffers are used for outputs at least this large ...
POOLED_MIN_BYTES = 4 << 20
# ... and idle pooled memory above this is freed.
MAX_IDLE_POOLED_BYTES = 1 << 30

_copiers: ThreadPoolExecutor | None = None
_copiers_lock = threading.Lock()


def _copy_pool() -> ThreadPoolExecutor:
    global _copiers
    with _copiers_lock:
        if _copiers is None:
            _copiers = ThreadPoolExecutor(max_workers=COPY_THREADS, thread_name_prefix="cuda-runner-stage")
        return _copiers


def staged_upload(runtime: Any, stream: int, device: int, source: np.ndarray, staging: np.ndarray, host_to_device: int) -> None:
    """Copy the C-contiguous bytes of `source` to `device` through `staging` (pinned,
    at least as large): chunks are staged by worker threads and each chunk's DMA is
    queued on `stream` once it is staged, in order."""
    flat = source.reshape(-1).view(np.uint8)
    target = staging.reshape(-1)
    nbytes = flat.nbytes
    chunks = [(start, min(start + CHUNK_BYTES, nbytes)) for start in range(0, nbytes, CHUNK_BYTES)]
    pool = _copy_pool()
    futures: list[Future[None]] = [pool.submit(np.copyto, target[start:end], flat[start:end]) for start, end in chunks]
    try:
        for (start, end), future in zip(chunks, futures):
            future.result()
            runtime.memcpyAsync(device + start, staging.ctypes.data + start, end - start, host_to_device, stream)
    finally:
        for future in futures:  # never leave a thread writing into staging after an error
            future.cancel()
            if not future.cancelled():
                future.exception()



def rounded_capacity(nbytes: int) -> int:
    """The size a reusable buffer for `nbytes` gets: a power of two, at least
    4 KiB, so that a buffer grows rarely as sizes vary."""
    return 1 << max(12, (max(nbytes, 1) - 1).bit_length())

class PinnedArrayOwner:
    """The base object of a pooled output array; its collection returns the buffer."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, address: int, nbytes: int):
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


class PinnedPool:
    """Pinned host buffers for outputs, reused once their arrays are released."""

    def __init__(self, runtime: Any):
        self._runtime = runtime
        self._idle: dict[int, list[int]] = {}  # capacity -> free pointers
        self._idle_bytes = 0
        self._lock = threading.Lock()
        # Finalizers only queue their buffer: they can run in the middle of any
        # allocation (a garbage collection), even inside this pool's lock.
        self._released: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()

    def array(self, nbytes: int) -> np.ndarray:
        """A uint8 array of `nbytes` pinned bytes, valid while it (or any view of it) lives."""
        capacity = rounded_capacity(nbytes)
        self._drain()
        with self._lock:
            free = self._idle.get(capacity)
            pointer = free.pop() if free else 0
            if pointer:
                self._idle_bytes -= capacity
        if not pointer:
            pointer = self._runtime.hostAlloc(capacity, 0)
        owner = PinnedArrayOwner(pointer, capacity)
        # Not at exit: the CUDA context may be gone by then, and the process frees it all anyway.
        weakref.finalize(owner, self._released.put, (pointer, capacity)).atexit = False
        return np.asarray(owner)[:nbytes]

    def _drain(self) -> None:
        """Take back the buffers whose arrays are gone; free those over the idle cap."""
        while True:
            try:
                pointer, capacity = self._released.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                keep = self._idle_bytes + capacity <= MAX_IDLE_POOLED_BYTES
                if keep:
                    self._idle.setdefault(capacity, []).append(pointer)
                    self._idle_bytes += capacity
            if not keep:
                self._runtime.freeHost(pointer)

    @property
    def idle_bytes(self) -> int:
        self._drain()
        return self._idle_bytes


_pool: PinnedPool | None = None
_pool_lock = threading.Lock()


def output_pool(runtime: Any) -> PinnedPool:
    """The process's pool (pinned host memory is usable with every device)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = PinnedPool(runtime)
        return _pool

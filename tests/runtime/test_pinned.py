"""Pooled pinned outputs and chunked staging: the bookkeeping, with host memory
standing in for the CUDA runtime (the real copies are tested on the GPU)."""

from __future__ import annotations

import ctypes
import gc

import numpy as np

from cuda_runner.runtime import pinned


class HostRuntime:
    """hostAlloc/freeHost/memcpyAsync over ordinary host memory."""

    def __init__(self):
        self.live: dict[int, ctypes.Array] = {}
        self.freed: list[int] = []

    def hostAlloc(self, size, flags):
        buffer = (ctypes.c_uint8 * size)()
        self.live[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def freeHost(self, pointer):
        self.freed.append(pointer)
        del self.live[pointer]

    def memcpyAsync(self, destination, source, size, kind, stream):
        ctypes.memmove(destination, source, size)


def test_a_pooled_output_stays_valid_while_any_view_of_it_lives():
    runtime = HostRuntime()
    pool = pinned.PinnedPool(runtime)
    output = pool.array(1 << 20).view(np.float32).reshape(512, 512)
    output[...] = 7
    view = output[100:200, 3]
    pointer = output.ctypes.data
    del output
    gc.collect()
    assert pool.idle_bytes == 0  # still held through the view
    again = pool.array(1 << 20)
    assert again.ctypes.data != pointer  # so a new buffer was handed out
    assert (view == 7).all()
    del view
    gc.collect()
    assert pool.idle_bytes == 1 << 20
    reused = pool.array(1 << 20)
    assert reused.ctypes.data == pointer  # reused only after its last array went


def test_idle_pooled_memory_is_bounded(monkeypatch):
    runtime = HostRuntime()
    monkeypatch.setattr(pinned, "MAX_IDLE_POOLED_BYTES", 3 << 20)
    pool = pinned.PinnedPool(runtime)
    arrays = [pool.array(1 << 20) for _ in range(5)]
    del arrays
    gc.collect()
    assert pool.idle_bytes == 3 << 20 and len(runtime.freed) == 2


def test_staged_upload_copies_every_chunk_in_order(monkeypatch):
    monkeypatch.setattr(pinned, "CHUNK_BYTES", 4096)
    runtime = HostRuntime()
    source = np.random.default_rng(0).integers(0, 255, 50_000, dtype=np.uint8)
    staging = np.zeros(65536, np.uint8)
    device = np.zeros(50_000, np.uint8)
    pinned.staged_upload(runtime, 0, device.ctypes.data, source, staging, 1)
    np.testing.assert_array_equal(device, source)


def test_a_new_lane_keeps_the_pinned_inputs_its_predecessor_handed_out():
    """reset_state replaces a blob method's lane and closes the old one:
    pinned_input arrays (valid until the method closes) must not be freed with it."""
    from cuda_runner.runtime.cuda import PinnedBuffers

    runtime = HostRuntime()
    old, new = PinnedBuffers(runtime), PinnedBuffers(runtime)
    handed = old.get(("user", 0), 64).view(np.float32)
    staging = old.get(("in", 0), 64)
    handed[...] = 3
    new.adopt_user_buffers(old)
    old.clear()  # the old lane closes
    assert runtime.freed == [staging.ctypes.data]
    assert (handed == 3).all() and handed.ctypes.data in runtime.live
    assert new.get(("user", 0), 64).ctypes.data == handed.ctypes.data  # the same buffer again, still recognised as pinned
    assert new.owns(handed)
    new.clear()
    assert not runtime.live

"""The parallel weight upload (runtime/upload.py): the bookkeeping, with host
memory standing in for the device (the real copies are tested on the GPU).

The stand-in runtime checks what the driver would refuse or get wrong: two
registrations that share a page, a copy from memory that is neither
registered nor staged, registrations left behind. It runs a stream's queued
copies only when something waits for them, as a busy copy engine may: an
uploader that refilled a staging slot, or let a registration go, before its
copy ran would upload the wrong bytes here."""

from __future__ import annotations

import ctypes
import linecache
import mmap
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from cuda_runner.runtime import upload
from cuda_runner.runtime.upload import PAGE, Upload, blocks_of, upload_all


class DriverError(Exception):
    pass


class LazyRuntime:
    CUDARuntimeError = DriverError

    def __init__(self, register: bool = True, pinned: bool = True, fail_after: int | None = None):
        self.lock = threading.Lock()
        self.can_register, self.can_pin = register, pinned
        self.registered: dict[int, int] = {}  # start -> end
        self.registrations = 0
        self.pinned: dict[int, ctypes.Array] = {}
        self.streams: dict[int, list[tuple[int, int, int]]] = {}
        self.done: dict[int, int] = {}
        self.events: dict[int, tuple[int, int]] = {}
        self.handles = 1
        self.fail_after = fail_after
        self.async_copies = 0
        self.plain_copies = 0

    def _handle(self) -> int:
        with self.lock:
            self.handles += 1
            return self.handles

    def setDevice(self, index):
        pass

    def hostRegister(self, start, size, flags):
        assert flags == upload.HOST_REGISTER_READ_ONLY and start % PAGE == 0 and size % PAGE == 0
        with self.lock:
            if not self.can_register:
                raise DriverError("cudaErrorNotSupported")
            for other, end in self.registered.items():
                assert start >= end or start + size <= other, "two registrations share a page"
            self.registered[start] = start + size
            self.registrations += 1

    def hostUnregister(self, start):
        with self.lock:
            del self.registered[start]

    def hostAlloc(self, size, flags):
        with self.lock:
            if not self.can_pin:
                raise DriverError("cudaErrorMemoryAllocation")
            buffer = (ctypes.c_uint8 * size)()
            self.pinned[ctypes.addressof(buffer)] = buffer
            return ctypes.addressof(buffer)

    def freeHost(self, pointer):
        with self.lock:
            del self.pinned[pointer]

    def eventCreateWithFlags(self, flags):
        handle = self._handle()
        self.events[handle] = (0, 0)
        return handle

    def eventDestroy(self, event):
        del self.events[event]

    def streamCreateWithFlags(self, flags):
        handle = self._handle()
        with self.lock:
            self.streams[handle], self.done[handle] = [], 0
        return handle

    def streamDestroy(self, stream):
        with self.lock:
            assert self.done[stream] == len(self.streams[stream]), "a stream destroyed with copies still queued"
            del self.streams[stream]

    def _readable(self, source, size) -> bool:
        inside = lambda start, end: start <= source and source + size <= end  # noqa: E731
        return any(inside(start, end) for start, end in self.registered.items()) or any(
            inside(pointer, pointer + len(buffer)) for pointer, buffer in self.pinned.items())

    def memcpyAsync(self, destination, source, size, kind, stream):
        with self.lock:
            self.async_copies += 1
            if self.fail_after is not None and self.async_copies > self.fail_after:
                raise DriverError("cudaErrorIllegalAddress")
            assert self._readable(source, size), "an asynchronous copy from memory that is not pinned"
            self.streams[stream].append((destination, source, size))

    def memcpy(self, destination, source, size, kind):
        self.plain_copies += 1
        ctypes.memmove(destination, source, size)

    def eventRecord(self, event, stream):
        with self.lock:
            self.events[event] = (stream, len(self.streams[stream]))

    def _run(self, stream, upto):
        with self.lock:
            queue = self.streams[stream]
            while self.done[stream] < upto:
                destination, source, size = queue[self.done[stream]]
                assert self._readable(source, size), "a registration let go, or a slot freed, before its copy ran"
                ctypes.memmove(destination, source, size)
                self.done[stream] += 1

    def eventSynchronize(self, event):
        stream, upto = self.events[event]
        if stream:
            self._run(stream, upto)

    def streamSynchronize(self, stream):
        self._run(stream, len(self.streams[stream]))

    def clean(self) -> bool:
        return not self.registered and not self.pinned and not self.events and not self.streams


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(upload, "BLOCK_BYTES", 4 * PAGE)
    monkeypatch.setattr(upload, "CHUNK_BYTES", 3000)
    monkeypatch.setattr(upload, "PIPELINE_MIN_BYTES", 8192)


class Mapped:
    """A file mapped as the bundle reader maps it, cut into segments (with gaps) of these sizes."""

    def __init__(self, tmp_path, sizes: list[int], gap: int = 100):
        rng = np.random.default_rng(sum(sizes))
        self.blobs = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]
        path = tmp_path / "weights.bin"
        path.write_bytes(b"".join(blob + bytes(gap) for blob in self.blobs))
        with path.open("rb") as handle:
            self.mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.views, offset = [], 0
        for size in sizes:
            self.views.append(memoryview(self.mapping)[offset:offset + size])
            offset += size + gap
        self.targets = [(ctypes.c_uint8 * max(1, size))() for size in sizes]
        self.uploads = [Upload(view, ctypes.addressof(target)) for view, target in zip(self.views, self.targets)]

    def arrived(self) -> bool:
        return all(bytes(target)[:len(blob)] == blob for blob, target in zip(self.blobs, self.targets))

    def close(self) -> None:
        self.uploads = []
        for view in self.views:
            view.release()
        self.mapping.close()


SIZES = [1, PAGE - 1, PAGE, 3 * PAGE + 5, 50_000, 0, 123_457]


@pytest.mark.parametrize("threads", [2, 3])
def test_every_byte_arrives_from_registered_blocks(tmp_path, small_blocks, threads):
    mapped = Mapped(tmp_path, SIZES)
    runtime = LazyRuntime()
    heard: list[tuple[int, int]] = []
    upload_all(runtime, 0, mapped.uploads, lambda done, total: heard.append((done, total)), threads=threads)
    assert mapped.arrived()
    assert runtime.registrations > 3 and runtime.clean()  # every registration let go, every stream destroyed
    total = sum(SIZES)
    assert heard[0] == (0, total) and heard[-1] == (total, total)
    assert [done for done, _ in heard] == sorted(done for done, _ in heard)
    mapped.close()


def test_blocks_cover_each_byte_once_and_share_no_page(tmp_path):
    mapped = Mapped(tmp_path, SIZES, gap=3 * PAGE)  # far enough apart to be extents of their own
    blocks = blocks_of(mapped.uploads, block_bytes=2 * PAGE)
    pages = [page for block in blocks for page in range(block.start, block.end, PAGE)]
    assert len(pages) == len(set(pages))
    assert all(block.start % PAGE == 0 and block.end % PAGE == 0 and block.end - block.start <= 2 * PAGE for block in blocks)
    covered = sorted((destination, size) for block in blocks for _, destination, size in block.copies)
    for upload_, size in zip(mapped.uploads, SIZES):
        mine = [(destination, length) for destination, length in covered if upload_.destination <= destination < upload_.destination + max(size, 1)]
        assert sum(length for _, length in mine) == size
    mapped.close()


def test_a_block_that_cannot_be_registered_is_staged(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, SIZES)
    runtime = LazyRuntime(register=False)
    upload_all(runtime, 0, mapped.uploads, threads=2)
    assert mapped.arrived() and runtime.clean() and runtime.async_copies > 10
    mapped.close()


def test_register_false_stages_every_block(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, SIZES)
    runtime = LazyRuntime()
    upload_all(runtime, 0, mapped.uploads, threads=2, register=False)
    assert mapped.arrived() and runtime.clean() and runtime.registrations == 0 and runtime.async_copies > 10
    mapped.close()


def test_without_registration_or_pinned_memory_the_copies_are_plain(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, SIZES)
    runtime = LazyRuntime(register=False, pinned=False)
    upload_all(runtime, 0, mapped.uploads, threads=2)
    assert mapped.arrived() and runtime.clean() and runtime.async_copies == 0 and runtime.plain_copies > 0
    mapped.close()


def test_a_small_total_is_copied_plainly(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, [3000, 2000])
    runtime = LazyRuntime()
    upload_all(runtime, 0, mapped.uploads, threads=4)
    assert mapped.arrived() and runtime.plain_copies == 2 and runtime.registrations == 0
    mapped.close()


def test_a_failed_copy_is_raised_after_every_thread_has_stopped(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, [200_000])
    runtime = LazyRuntime(fail_after=7)
    with pytest.raises(DriverError, match="IllegalAddress"):
        upload_all(runtime, 0, mapped.uploads, threads=3)
    assert runtime.async_copies < 7 + 3 + 1  # the others took no new block once one failed
    assert runtime.clean()  # its registration let go too
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("cuda-runner-upload")]
    mapped.close()


def test_a_copy_failing_inside_a_block_lets_the_earlier_copies_finish_and_is_the_error_raised(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, [3000] * 20)  # several copies a block
    runtime = LazyRuntime(fail_after=2)
    with pytest.raises(DriverError, match="IllegalAddress"):  # not a cleanup error in its place
        upload_all(runtime, 0, mapped.uploads, threads=2)
    assert runtime.clean()  # the stand-in asserts no registration went before its queued copies ran
    mapped.close()


def test_one_thread_still_registers_its_blocks(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, [200_000])
    runtime = LazyRuntime()
    upload_all(runtime, 0, mapped.uploads, threads=1)
    assert mapped.arrived() and runtime.registrations > 1 and runtime.plain_copies == 0
    mapped.close()


def test_a_block_size_off_the_page_size_is_rounded_to_whole_pages(tmp_path):
    mapped = Mapped(tmp_path, [10 * PAGE + 7])
    blocks = blocks_of(mapped.uploads, block_bytes=PAGE + 100)
    assert all(block.start % PAGE == 0 and block.end % PAGE == 0 for block in blocks)
    assert sum(block.nbytes for block in blocks) == 10 * PAGE + 7
    mapped.close()



class HeldRuntime(LazyRuntime):
    """Lets registrations go only once `go` is set: what upload_all returned before that was not waiting for them."""

    def __init__(self):
        super().__init__()
        self.go = threading.Event()
        self.unregistered_on: set[str] = set()

    def hostUnregister(self, start):
        if threading.current_thread().name == "cuda-runner-unregister":
            assert self.go.wait(10)
        self.unregistered_on.add(threading.current_thread().name.split("_")[0])
        super().hostUnregister(start)


def test_release_later_lets_the_registrations_go_after_the_upload_returns(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, [200_000])
    runtime = HeldRuntime()
    releasing = upload_all(runtime, 0, mapped.uploads, threads=2, release_later=True)
    assert releasing is not None and mapped.arrived()  # every byte is up while the registrations are still held
    assert runtime.registered and runtime.registrations > 1
    runtime.go.set()
    releasing.wait()
    assert runtime.clean() and runtime.unregistered_on == {"cuda-runner-unregister"}
    assert not upload._PENDING
    mapped.close()


def test_wait_for_releases_waits_for_every_upload(tmp_path, small_blocks):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = Mapped(tmp_path / "a", [50_000]), Mapped(tmp_path / "b", [60_000])
    runtime = HeldRuntime()
    upload_all(runtime, 0, first.uploads, threads=2, release_later=True)
    upload_all(runtime, 0, second.uploads, threads=2, release_later=True)
    waiter = threading.Thread(target=upload.wait_for_releases)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # still held
    runtime.go.set()
    waiter.join(10)
    assert not waiter.is_alive() and runtime.clean()
    first.close()
    second.close()


def test_release_later_holds_no_more_than_its_budget_past_the_upload(tmp_path, small_blocks, monkeypatch):
    monkeypatch.setattr(upload, "RELEASE_LATER_BYTES", 8 * PAGE)  # two blocks of four pages
    mapped = Mapped(tmp_path, [200_000])
    runtime = HeldRuntime()
    releasing = upload_all(runtime, 0, mapped.uploads, threads=2, release_later=True)
    assert mapped.arrived() and sum(end - start for start, end in runtime.registered.items()) == 8 * PAGE
    runtime.go.set()
    releasing.wait()
    assert runtime.clean() and len(runtime.unregistered_on) == 2  # the rest went inline, on the upload's threads
    mapped.close()


def test_a_failed_upload_holds_no_registration_when_it_raises(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, [200_000])
    runtime = LazyRuntime(fail_after=7)
    with pytest.raises(DriverError, match="IllegalAddress"):
        upload_all(runtime, 0, mapped.uploads, threads=3, release_later=True)
    assert runtime.clean() and not upload._PENDING
    mapped.close()


def test_a_wait_for_the_release_goes_on_through_an_interrupt(tmp_path, small_blocks, monkeypatch):
    mapped = Mapped(tmp_path, [200_000])
    runtime = HeldRuntime()
    releasing = upload_all(runtime, 0, mapped.uploads, threads=2, release_later=True)
    real_idle = releasing._idle
    calls = []

    def interrupted_once():
        calls.append(len(calls))
        if len(calls) == 1:
            runtime.go.set()
            raise KeyboardInterrupt
        real_idle()

    monkeypatch.setattr(releasing, "_idle", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        releasing.wait()
    assert calls == [0, 1] and runtime.clean()  # waited on to the end, then the interrupt raised
    mapped.close()


def test_an_interrupt_before_the_releasing_thread_starts_leaves_the_registrations_to_the_next_wait(tmp_path, small_blocks, monkeypatch):
    mapped = Mapped(tmp_path, [200_000])
    runtime = LazyRuntime()

    real_start = threading.Thread.start

    def interrupted_start(self):
        if self.name == "cuda-runner-unregister":
            raise KeyboardInterrupt  # due before the thread ran: it never does
        real_start(self)

    monkeypatch.setattr(upload.threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        upload_all(runtime, 0, mapped.uploads, threads=1, release_later=True)
    assert mapped.arrived() and runtime.registered  # held, and owned by nothing running
    monkeypatch.undo()
    upload.wait_for_releases()  # returns: the waiter lets them go itself
    assert runtime.clean() and not upload._PENDING
    mapped.close()


def test_a_progress_callback_raising_at_the_end_leaves_nothing_held_past_the_next_wait(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, [200_000])
    runtime = LazyRuntime()

    ends = []

    def progress(done, total):
        if done == total:
            ends.append(done)
            if len(ends) == 2:  # the loop's last report, then upload_all's own at its end
                raise KeyboardInterrupt  # Ctrl-C in the progress bar's last update

    with pytest.raises(KeyboardInterrupt):
        upload_all(runtime, 0, mapped.uploads, progress, threads=2, release_later=True)
    assert len(ends) == 2
    upload.wait_for_releases()
    assert runtime.clean() and not upload._PENDING
    mapped.close()


def test_interrupts_while_the_workers_stop_are_waited_through(tmp_path, small_blocks, monkeypatch):
    mapped = Mapped(tmp_path, [200_000])

    class SlowRuntime(HeldRuntime):
        def streamSynchronize(self, stream):
            time.sleep(0.15)  # blocks still in flight when the progress loop first reports
            super().streamSynchronize(stream)

    runtime = SlowRuntime()
    real_wait = upload.wait
    interrupts_left = [3]

    def wait(futures, timeout=None, return_when=None):
        if timeout is None and interrupts_left[0]:  # the wait for the workers to stop, cut short again and again
            interrupts_left[0] -= 1
            raise KeyboardInterrupt
        return real_wait(futures, timeout=timeout) if return_when is None else real_wait(futures, timeout=timeout, return_when=return_when)

    def progress(done, total):
        if done < total and progress.calls:
            raise KeyboardInterrupt  # Ctrl-C while blocks are in flight
        progress.calls += 1

    progress.calls = 0

    monkeypatch.setattr(upload, "wait", wait)
    with pytest.raises(KeyboardInterrupt):
        upload_all(runtime, 0, mapped.uploads, progress, threads=3, release_later=True)
    assert not interrupts_left[0]
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("cuda-runner-upload")]  # none still copying
    runtime.go.set()
    upload.wait_for_releases()
    assert runtime.clean() and not upload._PENDING
    mapped.close()


def test_a_forked_child_does_not_wait_for_its_parents_releases(tmp_path, small_blocks):
    mapped = Mapped(tmp_path, [200_000])
    runtime = HeldRuntime()
    releasing = upload_all(runtime, 0, mapped.uploads, threads=2, release_later=True)
    assert releasing is not None and upload._PENDING
    child = os.fork()
    if child == 0:  # the child: the parent's releasing thread is not here
        try:
            upload.wait_for_releases()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 10
    while (finished := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if finished[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    runtime.go.set()
    releasing.wait()
    assert finished[0] == child and os.waitstatus_to_exitcode(finished[1]) == 0
    assert runtime.clean()
    mapped.close()


@pytest.mark.parametrize("interrupted_at", [1, 2])
def test_an_interrupt_while_registrations_are_let_go_loses_none_and_lets_none_go_twice(tmp_path, small_blocks, interrupted_at):
    """A Ctrl-C between two unregistrations: those not yet tried are the next waiter's, and the one
    just let go is not let go again (by then a later upload may have registered its pages anew)."""
    mapped = Mapped(tmp_path, [200_000])

    class Counting(LazyRuntime):
        def __init__(self):
            super().__init__()
            self.unregistered: list[int] = []

        def hostUnregister(self, start):
            self.unregistered.append(start)
            super().hostUnregister(start)

    runtime = Counting()
    held = upload.HeldRegistrations(runtime, 0, budget=1 << 30)
    for block in blocks_of(mapped.uploads):
        runtime.hostRegister(block.start, block.end - block.start, upload.HOST_REGISTER_READ_ONLY)
        assert held.keep(block)
    loop_lines = []

    def interrupt_in_the_loop(frame, event, arg):
        if frame.f_code.co_name != "let_go":
            return None
        if event == "line" and "tried = index + 1" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            loop_lines.append(frame.f_lineno)
            if len(loop_lines) == interrupted_at:
                sys.settrace(None)
                raise KeyboardInterrupt
        return interrupt_in_the_loop

    sys.settrace(interrupt_in_the_loop)
    try:
        with pytest.raises(KeyboardInterrupt):
            held.end(later=False)
    finally:
        sys.settrace(None)
    assert len(runtime.unregistered) == interrupted_at - 1 and runtime.registered and held in upload._PENDING
    upload.wait_for_releases()  # neither lost nor waited on forever
    assert runtime.clean() and held not in upload._PENDING
    assert sorted(runtime.unregistered) == sorted(set(runtime.unregistered))  # none twice
    mapped.close()


def test_a_ctrl_c_in_the_wait_for_the_workers_is_raised_once_they_are_done(tmp_path, small_blocks, monkeypatch):
    mapped = Mapped(tmp_path, [200_000])
    runtime = LazyRuntime()
    real_wait, cut = upload.wait, []

    def wait(futures, timeout=None, return_when=None):
        if timeout is None and not cut:
            cut.append(True)
            raise KeyboardInterrupt  # the upload itself went well
        return real_wait(futures, timeout=timeout) if return_when is None else real_wait(futures, timeout=timeout, return_when=return_when)

    monkeypatch.setattr(upload, "wait", wait)
    with pytest.raises(KeyboardInterrupt):  # not lost
        upload_all(runtime, 0, mapped.uploads, threads=2, release_later=True)
    assert mapped.arrived()
    upload.wait_for_releases()
    assert runtime.clean() and not upload._PENDING
    mapped.close()

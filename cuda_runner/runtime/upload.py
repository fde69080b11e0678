"""Weights from the bundle mapping to GPU memory at the link's speed.

A gigabyte-scale model's storages live in the mapped bundle file, in the page
cache once the file has been read. The copy engine reads them where they are:
a range of the mapping is registered as pinned memory (read-only) and DMA
copies are queued from it. Registering is the CPU's share of the work, so the
storages are cut into blocks of BLOCK_BYTES that several threads register and
copy at once, each on a stream of its own. On the H200 machines this moved
the 1B decoder's 2.2 GB from a fresh mapping at 17-20 GB/s, about the same
from 2 to 16 threads and with the pages mapped in first or not: the
registrations appear to be serialized (pinned memory itself goes at 55).
Reading the blocks from the file with pread into pinned slots was slower
(16 GB/s at best: the CPU's copy out of the page cache), staging from the
mapping 16-17 and copying from the pageable mapping 7 (scripts/bench_upload.py;
docs/benchmarks.md, "Weights at GB scale").

Letting a registration go took 0.016 s of the 1B decoder's 0.1 s upload on
one thread. With `release_later` (as loads upload), up to
RELEASE_LATER_BYTES of registrations are let go by a thread of their own once
every copy has arrived, off the load's path; `wait_for_releases()` waits for
them (before a CUDA graph capture, before the bundle mapping closes). The
same 2.2 GB then went at 28.8 GB/s on 4 threads, against 17.8 letting each go
inline: the threads' copies overlap each other's registrations. A failed or
interrupted upload lets every registration go before it raises; an upload
is listed from before its first registration, and a waiter lets go itself
of what no releasing thread has taken. Known limits: a capture waits for the
uploads begun before it, not for a load another thread starts during it; and
where two methods' storages share a page, the second's block may be refused
while the first's registration of that page is still held, and is staged.

Where a block cannot be registered (a kernel or driver that refuses it), it
is copied through two staging slots of the thread instead, and where no
pinned memory can be had either, by plain copies. Every byte uploaded is read
from the mapping the bundle reader checks its digests on. The caller hears
how many bytes are up, from its own thread (`progress(done, total)`), for a
progress bar.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import Interrupted
from . import interrupts
from .host import buffer_address

HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the mapping is read-only
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
PAGE = mmap.PAGESIZE

# Below this much in all, one plain copy per storage costs less than threads.
PIPELINE_MIN_BYTES = 64 << 20
BLOCK_BYTES = 64 << 20  # one registration
CHUNK_BYTES = 8 << 20  # one staging slot, where a block cannot be registered
MAX_THREADS = 4
# Registrations left to a releasing thread at most (`release_later`): beyond this, pages
# of a large model would stay pinned at once for the whole upload, so the rest go inline.
RELEASE_LATER_BYTES = 8 << 30

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Upload:
    """Host bytes (a view of the bundle mapping) and the device memory they go to."""

    source: memoryview
    destination: int


@dataclass
class _Block:
    """A page-aligned range of host memory and the copies that read from it."""

    start: int
    end: int
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (source address, destination, bytes)

    @property
    def nbytes(self) -> int:
        return sum(size for _, _, size in self.copies)


def upload_all(runtime: Any, device_index: int, uploads: Sequence[Upload], progress: Progress | None = None,
               threads: int | None = None, register: bool = True, release_later: bool = False) -> HeldRegistrations | None:
    """Copy every upload's bytes to its destination; returns once all are on the device.
    `register=False` stages every block, as where registration is refused (for measuring).
    With `release_later`, the registrations still held are let go on a thread of their
    own, returned (None where none is held): its wait() returns once they all are."""
    total = sum(upload.source.nbytes for upload in uploads)
    report = progress or (lambda done, total: None)
    report(0, total)
    if total == 0:
        return None
    runtime.setDevice(device_index)
    count = threads or min(MAX_THREADS, _usable_cpus())
    if total < PIPELINE_MIN_BYTES:
        done = 0
        for upload in uploads:
            if upload.source.nbytes:
                runtime.memcpy(upload.destination, buffer_address(upload.source), upload.source.nbytes, HOST_TO_DEVICE)
            done += upload.source.nbytes
            report(done, total)
        return None
    for upload in uploads:
        advise_will_need(upload.source)
    blocks = blocks_of(uploads)
    # Listed for wait_for_releases before the first registration, whatever ends the upload.
    held = HeldRegistrations(runtime, device_index, RELEASE_LATER_BYTES if release_later else 0)
    copied = False
    try:
        _run_workers(runtime, device_index, blocks, min(count, len(blocks)), report, total, register, held)
        copied = True
    finally:
        held.end(later=copied)  # a failed or interrupted upload lets go of everything here, before it raises
    report(total, total)
    return held if held.holding() else None


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def blocks_of(uploads: Sequence[Upload], block_bytes: int | None = None) -> list[_Block]:
    """The uploads' source ranges as disjoint page-aligned blocks of at most
    `block_bytes` (BLOCK_BYTES, rounded up to whole pages), each with the
    copies (or parts of copies) it holds. Ranges whose pages meet are one
    extent before it is cut: no page is in two blocks, so no two
    registrations overlap."""
    size = -(-(block_bytes or BLOCK_BYTES) // PAGE) * PAGE
    pieces = sorted((buffer_address(upload.source), upload.destination, upload.source.nbytes) for upload in uploads if upload.source.nbytes)
    extents: list[list[Any]] = []  # [start, end, pieces]
    for address, destination, nbytes in pieces:
        start, end = address - address % PAGE, -(-(address + nbytes) // PAGE) * PAGE
        if extents and start <= extents[-1][1]:
            extents[-1][1] = max(extents[-1][1], end)
            extents[-1][2].append((address, destination, nbytes))
        else:
            extents.append([start, end, [(address, destination, nbytes)]])
    blocks = []
    for start, end, members in extents:
        cuts = [_Block(low, min(low + size, end)) for low in range(start, end, size)]
        for address, destination, nbytes in members:
            for block in cuts[(address - start) // size:]:
                low, high = max(address, block.start), min(address + nbytes, block.end)
                if low >= address + nbytes:
                    break
                if high > low:
                    block.copies.append((low, destination + (low - address), high - low))
        blocks += [block for block in cuts if block.copies]
    return blocks


def advise_will_need(view: memoryview) -> None:
    """Ask the kernel to start reading a mapped range from disk now (a bundle
    not in the page cache): the registrations then find it read, or being read."""
    base = getattr(view, "obj", None)
    if not isinstance(base, mmap.mmap) or not hasattr(mmap, "MADV_WILLNEED"):
        return
    start = buffer_address(view) - buffer_address(memoryview(base))
    aligned = start - start % PAGE
    try:
        base.madvise(mmap.MADV_WILLNEED, aligned, view.nbytes + start - aligned)
    except (OSError, ValueError):
        pass  # only a hint


class _Queue:
    """The blocks still to copy, handed out one at a time, and the bytes done so far."""

    def __init__(self, blocks: list[_Block]):
        self._blocks = blocks
        self._next = 0
        self._done = 0
        self._stopped = False
        self._lock = threading.Lock()

    def take(self, finished: int) -> _Block | None:
        with self._lock:
            self._done += finished
            if self._stopped or self._next == len(self._blocks):
                return None
            block = self._blocks[self._next]
            self._next += 1
            return block

    def done_bytes(self) -> int:
        with self._lock:
            return self._done

    def stop(self) -> None:
        with self._lock:
            self._stopped = True


class HeldRegistrations:
    """One upload's registrations whose copies have all arrived, up to a byte
    budget, let go once it ends: on a thread of its own (`end(later=True)`), or
    where it ends. It is listed in _PENDING from before the first registration
    until all it held is let go, so wait_for_releases sees it whatever
    interrupts the upload; a waiter lets go itself of what no thread has taken."""

    def __init__(self, runtime: Any, device_index: int, budget: int):
        self._runtime, self._device_index = runtime, device_index
        self._left = budget
        self._starts: list[int] = []
        self._ended = False  # the upload is over: nothing more is kept
        # One token per let_go under way, by a thread or a waiter. A plain lock and
        # idempotent steps: an interrupt between any two of them loses nothing and
        # leaves no count behind (a Condition's own Python code was such a gap).
        self._letting_go: set[object] = set()
        self._lock = threading.Lock()
        with _PENDING_LOCK:
            _PENDING.add(self)

    def keep(self, block: _Block) -> bool:
        """True where the block's registration is now this one's to let go."""
        size = block.end - block.start
        with self._lock:
            if self._ended or size > self._left:
                return False
            self._left -= size
            self._starts.append(block.start)
            return True

    def holding(self) -> bool:
        with self._lock:
            return bool(self._starts or self._letting_go)

    def let_go(self) -> None:
        """Unregister what is held now. Driver errors are dropped (at worst pages stay
        pinned); an interrupt met is raised once every one has been tried."""
        token = object()
        starts: list[int] = []
        tried = 0
        interrupted: BaseException | None = None
        try:
            with self._lock:
                starts, self._starts = self._starts, []
                self._letting_go.add(token)
            for index, start in enumerate(starts):
                # Counted before the call: one an interrupt cuts in around is never let go
                # twice (the same pages may be registered again by a later upload by then).
                tried = index + 1
                try:
                    if index == 0:
                        self._runtime.setDevice(self._device_index)
                    self._runtime.hostUnregister(start)
                except (KeyboardInterrupt, Interrupted) as error:
                    interrupted = interrupted or error  # raised once all are let go
                except BaseException:
                    pass
        finally:
            # Taken, but an interrupt came before they were tried: they are the next waiter's.
            interrupts.finish_through(lambda: self._settle(token, starts[tried:]))
        self._forget_when_done()
        if interrupted is not None:
            raise interrupted

    def _settle(self, token: object, unreleased: list[int]) -> None:
        with self._lock:
            if token in self._letting_go:
                self._starts += unreleased
                self._letting_go.discard(token)

    def end(self, later: bool) -> None:
        """The upload is over: what is held is let go on a thread of its own (`later`), or here."""
        with self._lock:
            self._ended = True
            holding = bool(self._starts)
        if later and holding:
            # Not a daemon: the interpreter waits for it at exit, so the driver is never torn down under it.
            # Were it never to start (an interrupt inside start()), the next wait lets go instead.
            with interrupts.held_back():
                threading.Thread(target=self.let_go, name="cuda-runner-unregister").start()
            return
        self.let_go()

    def wait(self) -> None:
        """Return once nothing it held is registered: what no thread has taken goes here, and
        a thread letting go of the rest is waited for, through any interrupt."""
        self.let_go()
        interrupts.finish_through(self._idle)

    def _idle(self) -> None:
        # Polled: it is a wait of milliseconds at most, and a plain lock has no wait to be cut short inside.
        while True:
            with self._lock:
                if not self._letting_go:
                    return
            time.sleep(0.001)

    def _forget_when_done(self) -> None:
        with self._lock:
            done = self._ended and not self._starts and not self._letting_go
        if done:
            with _PENDING_LOCK:
                _PENDING.discard(self)


def _run_workers(runtime: Any, device_index: int, blocks: list[_Block], count: int, report: Progress, total: int, register: bool,
                 held: HeldRegistrations) -> None:
    queue = _Queue(blocks)
    futures: list[Future[None]] = []
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="cuda-runner-upload") as pool:
        try:
            for _ in range(count):  # inside the try: an interrupt between two submits still stops the first
                futures.append(pool.submit(_worker, runtime, device_index, queue, register, held))
            while True:
                finished, _ = wait(futures, timeout=0.1, return_when=FIRST_EXCEPTION)
                report(queue.done_bytes(), total)
                if len(finished) == len(futures) or any(future.exception() for future in finished):
                    break
        except BaseException:
            queue.stop()  # an error (or an interrupt) here: the others take no new block
            # Each waited for, through any further interrupt (what is already on its way is
            # raised): no copy is in flight, and no block is kept, once this returns.
            with contextlib.suppress(KeyboardInterrupt, Interrupted):
                interrupts.finish_through(lambda: wait(futures))
            raise
        interrupts.finish_through(lambda: wait(futures))  # an interrupt met in the wait is raised after it
    for future in futures:
        future.result()  # the first error, re-raised


def _worker(runtime: Any, device_index: int, queue: _Queue, register: bool, held: HeldRegistrations) -> None:
    runtime.setDevice(device_index)
    stream = runtime.streamCreateWithFlags(_STREAM_NON_BLOCKING)
    staging: _Staging | None = None
    failed = True
    try:
        finished = 0
        while (block := queue.take(finished)) is not None:
            if not (register and _copy_registered(runtime, stream, block, held)):
                staging = staging or _Staging.allocate(runtime)
                if staging is not None:
                    staging.copy(stream, block)
                else:  # no pinned memory either: the driver's own pageable copy
                    for source, destination, nbytes in block.copies:
                        runtime.memcpy(destination, source, nbytes, HOST_TO_DEVICE)
            finished = block.nbytes
        failed = False
    finally:
        # Every copy queued has run before the slots go; a failure here never hides the one that ended the loop.
        _clean_up([lambda: runtime.streamSynchronize(stream), lambda: runtime.streamDestroy(stream),
                   lambda: staging.free() if staging is not None else None], quietly=failed)


def _copy_registered(runtime: Any, stream: int, block: _Block, held: HeldRegistrations) -> bool:
    """Register the block, DMA its copies straight from it, let it go (or leave it to
    `held`, once its copies have arrived); False where it cannot be registered."""
    try:
        runtime.hostRegister(block.start, block.end - block.start, HOST_REGISTER_READ_ONLY)
    except runtime.CUDARuntimeError:
        return False
    failed = True
    try:
        for source, destination, nbytes in block.copies:
            runtime.memcpyAsync(destination, source, nbytes, HOST_TO_DEVICE, stream)
        runtime.streamSynchronize(stream)  # the DMA has read the pages before they are let go
        failed = False
    finally:
        if failed or not held.keep(block):
            # After a failed copy, the ones queued before it finish before the pages are let go.
            steps = [lambda: runtime.streamSynchronize(stream)] if failed else []
            _clean_up([*steps, lambda: runtime.hostUnregister(block.start)], quietly=failed)
    return True


# The uploads whose registrations are not all let go yet (wait_for_releases).
_PENDING: set[HeldRegistrations] = set()
_PENDING_LOCK = threading.Lock()


def wait_for_releases() -> None:
    """Return once no upload that has ended holds a registration: before anything the
    driver must not see them change under (a CUDA graph capture), or the mapping they
    are in closes. An upload still running lets go of what it holds so far."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
    for held in pending:
        held.wait()


def _forget_pending() -> None:
    """A forked child has none of its parent's threads or registrations (nor a lock one held)."""
    global _PENDING, _PENDING_LOCK
    _PENDING, _PENDING_LOCK = set(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pending)


def _clean_up(steps: Sequence[Callable[[], Any]], quietly: bool) -> None:
    """Run every step. With an error already on its way (`quietly`), theirs are dropped so
    that it is the one raised; otherwise the first of theirs is raised once all have run."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as error:
            first = first or error
    if first is not None and not quietly:
        raise first


class _Staging:
    """Two pinned slots of CHUNK_BYTES, filled in turn, each with the event of its last DMA."""

    def __init__(self, runtime: Any):
        self._runtime = runtime
        self.slots: list[int] = []
        self.events: list[int] = []
        self._used = [False, False]
        self._turn = 0

    @classmethod
    def allocate(cls, runtime: Any) -> _Staging | None:
        """Two slots, or None where pinned memory cannot be had (a memlock limit)."""
        staging = cls(runtime)
        try:
            for _ in range(2):
                staging.slots.append(runtime.hostAlloc(CHUNK_BYTES, 0))
                staging.events.append(runtime.eventCreateWithFlags(_EVENT_DISABLE_TIMING))
        except runtime.CUDARuntimeError:
            staging.free()
            return None
        return staging

    def copy(self, stream: int, block: _Block) -> None:
        runtime = self._runtime
        for source, destination, nbytes in block.copies:
            for offset in range(0, nbytes, CHUNK_BYTES):
                size = min(CHUNK_BYTES, nbytes - offset)
                turn = self._turn
                if self._used[turn]:
                    runtime.eventSynchronize(self.events[turn])  # its last DMA has read the slot
                slot = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(self.slots[turn]))
                slot[...] = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(source + offset))
                runtime.memcpyAsync(destination + offset, self.slots[turn], size, HOST_TO_DEVICE, stream)
                runtime.eventRecord(self.events[turn], stream)
                self._used[turn] = True
                self._turn = 1 - turn

    def free(self) -> None:
        for event in self.events:
            self._runtime.eventDestroy(event)
        for slot in self.slots:
            self._runtime.freeHost(slot)
        self.events, self.slots = [], []

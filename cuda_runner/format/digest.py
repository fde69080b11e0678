"""Segment digests: XXH3-128 over the XXH3-128 digests of 16 MiB chunks.

Hashing chunks independently lets a reader check a multi-GB weights segment on
all cores at once (python-xxhash releases the GIL), and overlap that with
loading the weights (docs/bundle-format.md, "Integrity").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

DIGEST_ALGORITHM = "xxh3-128-tree16m"
DIGEST_CHUNK = 16 << 20


def _chunks(data: bytes | memoryview) -> list[memoryview]:
    view = memoryview(data).cast("B")
    return [view[start:start + DIGEST_CHUNK] for start in range(0, len(view), DIGEST_CHUNK)]


def _combine(chunk_digests: list[bytes]) -> str:
    return f"{DIGEST_ALGORITHM}:{xxhash.xxh3_128_hexdigest(b''.join(chunk_digests))}"


def segment_digest(data: bytes | memoryview, *, workers: int | None = None) -> str:
    """The digest string of a segment's bytes, its chunks hashed on the
    process's hashing threads, or on a pool of `workers` threads of its own."""
    chunks = _chunks(data)
    if len(chunks) <= 1 or workers == 1:
        return _combine([xxhash.xxh3_128_digest(chunk) for chunk in chunks])
    if workers is None:
        return _combine(list(_hashing_pool().map(xxhash.xxh3_128_digest, chunks)))
    with ThreadPoolExecutor(max_workers=min(len(chunks), workers), thread_name_prefix="cuda-runner-digest") as pool:
        return _combine(list(pool.map(xxhash.xxh3_128_digest, chunks)))


_hashing: ThreadPoolExecutor | None = None
_hashing_lock = threading.Lock()


def _hashing_pool() -> ThreadPoolExecutor:
    """One pool of hashing threads for the process. A load checks each of a
    model's storages (181 for the 1B decoder) on the checking threads at once;
    a pool of all the cores' threads made and joined for each segment was
    thousands of thread starts competing with the load for the GIL."""
    global _hashing
    with _hashing_lock:
        if _hashing is None:
            _hashing = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="cuda-runner-digest")
        return _hashing


class TreeHasher:
    """The same digest, fed incrementally (the writer streams segments)."""

    def __init__(self) -> None:
        self._digests: list[bytes] = []
        self._current = xxhash.xxh3_128()
        self._filled = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), DIGEST_CHUNK - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == DIGEST_CHUNK:
                self._digests.append(self._current.digest())
                self._current, self._filled = xxhash.xxh3_128(), 0

    def hexdigest(self) -> str:
        digests = self._digests + ([self._current.digest()] if self._filled else [])
        return _combine(digests)


_checks: ThreadPoolExecutor | None = None
_checks_lock = threading.Lock()


def in_background(check: Callable[..., None], *args: Any) -> Future[None]:
    """Run a data check on the process's pool of checking threads. One pool for
    all, a few threads wide: a method may check 65,536 constant segments, and a
    thread (or pool) for each made loading quadratic."""
    global _checks
    with _checks_lock:
        if _checks is None:
            _checks = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="cuda-runner-verify")
        return _checks.submit(check, *args)


class OneCheckEach:
    """A reader's background checks, one per segment: a method loaded after
    another that holds the same weights waits on the check made or under way
    instead of hashing them again (the 1B decoder's decode method hashed its
    2.2 GB a second time, 0.036 s of its load). A check found cancelled (a
    failed load stopped it) is started afresh; one that failed fails alike."""

    def __init__(self) -> None:
        self._futures: dict[str, Future[None]] = {}
        self._lock = threading.Lock()

    def start(self, name: str, check: Callable[..., None], *args: Any) -> Future[None]:
        with self._lock:
            future = self._futures.get(name)
            if future is None or future.cancelled():
                future = self._futures[name] = in_background(check, *args)
            return future

    def forget(self, name: str) -> None:
        """The next check of `name` hashes again (a re-check asked for)."""
        with self._lock:
            self._futures.pop(name, None)


def _forget_pools() -> None:
    """A forked child has none of its parent's threads (nor a lock one held): it makes pools of its own."""
    global _hashing, _checks, _hashing_lock, _checks_lock
    _hashing, _checks = None, None
    _hashing_lock, _checks_lock = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)

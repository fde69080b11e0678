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
    """The digest string of a segment's bytes, its chunks hashed on up to `workers` threads."""
    chunks = _chunks(data)
    workers = min(len(chunks), workers or os.cpu_count() or 1)
    if workers <= 1:
        return _combine([xxhash.xxh3_128_digest(chunk) for chunk in chunks])
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cuda-runner-digest") as pool:
        return _combine(list(pool.map(xxhash.xxh3_128_digest, chunks)))


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

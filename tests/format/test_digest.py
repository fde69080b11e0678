from __future__ import annotations

import os
import random
import signal

import pytest
from forge import digest as spec_digest

from cuda_runner.format.digest import DIGEST_CHUNK, TreeHasher, segment_digest


def test_digest_follows_the_specified_chunked_construction():
    for size in (0, 1, DIGEST_CHUNK - 1, DIGEST_CHUNK, DIGEST_CHUNK + 1, 2 * DIGEST_CHUNK + 5):
        data = os.urandom(size)
        assert segment_digest(data) == spec_digest(data)
        assert segment_digest(data, workers=1) == segment_digest(data, workers=8)


def test_streamed_digest_equals_the_whole_one_for_any_split():
    data = os.urandom(2 * DIGEST_CHUNK + 12345)
    rng = random.Random(0)
    for _ in range(5):
        hasher = TreeHasher()
        position = 0
        while position < len(data):
            step = rng.choice([1, 4096, DIGEST_CHUNK - 3, 8 << 20])
            hasher.update(data[position:position + step])
            position += step
        assert hasher.hexdigest() == segment_digest(data)


def test_any_changed_byte_changes_the_digest():
    data = bytearray(os.urandom(DIGEST_CHUNK + 100))
    reference = segment_digest(bytes(data))
    for offset in (0, DIGEST_CHUNK - 1, DIGEST_CHUNK, len(data) - 1):
        data[offset] ^= 0x40
        assert segment_digest(bytes(data)) != reference
        data[offset] ^= 0x40


def test_background_checks_share_a_few_threads():
    """A method with thousands of constant segments checks each on a shared pool;
    a thread per segment made loading 65,535 of them take minutes."""
    import threading

    from cuda_runner.format.digest import in_background

    release = threading.Event()
    futures = [in_background(release.wait, 10) for _ in range(200)]
    checking = [thread for thread in threading.enumerate() if thread.name.startswith("cuda-runner-verify")]
    release.set()
    for future in futures:
        future.result()
    assert 1 <= len(checking) <= 4


def test_segments_hashed_at_once_share_one_pool_of_hashing_threads():
    """Many multi-chunk segments checked at once (a load's storages) start no
    pool of their own each: the hashing threads are the process's few."""
    import threading

    from cuda_runner.format.digest import in_background

    data = os.urandom(2 * DIGEST_CHUNK + 1)
    reference = segment_digest(data, workers=1)
    before = {thread.ident for thread in threading.enumerate()}
    futures = [in_background(segment_digest, data) for _ in range(12)]
    assert all(future.result() == reference for future in futures)
    started = [thread for thread in threading.enumerate() if thread.ident not in before and thread.name.startswith("cuda-runner-digest")]
    assert len(started) <= min(16, os.cpu_count() or 1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_hashes_on_threads_of_its_own():
    data = os.urandom(2 * DIGEST_CHUNK + 1)
    reference = segment_digest(data)  # the parent's pool exists now
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's exit status is the assertion)
        signal.alarm(30)  # a child waiting on its parent's dead threads is killed, not waited for forever
        os._exit(0 if segment_digest(data) == reference else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_manifest_segments_are_found_by_name():
    from cuda_runner.format.manifest import Manifest, SegmentEntry

    entries = tuple(SegmentEntry(f"s{index}", index * 64, 64, "xxh3-128-tree16m:" + "0" * 32) for index in range(70000))
    manifest = Manifest(methods={}, segments=entries)
    assert manifest.segment("s69999") is entries[-1] and manifest.segment("missing") is None


def test_one_check_each_runs_a_segments_check_once_and_again_after_a_cancel_or_forget(monkeypatch):
    from concurrent.futures import Future

    from cuda_runner.format import digest

    started: list[Future[None]] = []

    def pending(check, *args):
        future: Future[None] = Future()
        started.append(future)
        return future

    monkeypatch.setattr(digest, "in_background", pending)
    checks = digest.OneCheckEach()
    first = checks.start("w", lambda: None)
    assert checks.start("w", lambda: None) is first and len(started) == 1  # under way: the same check
    assert checks.start("other", lambda: None) is not first
    first.set_exception(ValueError("damaged"))
    assert checks.start("w", lambda: None) is first  # failed: fails alike for the next method
    checks.forget("w")
    second = checks.start("w", lambda: None)
    assert second is not first
    assert second.cancel()  # a failed load stopped it before it ran
    assert checks.start("w", lambda: None) not in (first, second) and len(started) == 4

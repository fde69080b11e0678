from __future__ import annotations

import os
import random

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


def test_manifest_segments_are_found_by_name():
    from cuda_runner.format.manifest import Manifest, SegmentEntry

    entries = tuple(SegmentEntry(f"s{index}", index * 64, 64, "xxh3-128-tree16m:" + "0" * 32) for index in range(70000))
    manifest = Manifest(methods={}, segments=entries)
    assert manifest.segment("s69999") is entries[-1] and manifest.segment("missing") is None
